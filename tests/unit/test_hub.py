"""Hub ids (``org/name``) resolve through the local Hugging Face cache and never download implicitly."""

import hashlib

import pytest

import musecore
from musecore import hub
from musecore.api import BUNDLED
from musecore.cli import main

pytest.importorskip("huggingface_hub", reason="Hub ids are resolved with huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root, repo="my-org/muse-tiny-copy", commit=COMMIT, ref="main"):
    """The cache layout huggingface_hub writes: refs/<ref> -> commit, snapshots/<commit>/* -> blobs/<sha>."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / ref).write_text(commit)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    for f in sorted((BUNDLED / "muse-tiny").iterdir()):
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(blob)
    return snapshot


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
    return root


def test_a_cached_hub_id_loads_and_generates_like_the_bundled_model(cache):
    snapshot = fake_cache(cache)
    assert hub.resolve("my-org/muse-tiny-copy") == snapshot
    model = musecore.load("my-org/muse-tiny-copy", device="cpu")
    bundled = musecore.load("muse-tiny", device="cpu")
    assert model.generate("def f(x):", max_new_tokens=6) == bundled.generate("def f(x):", max_new_tokens=6)


def test_a_revision_after_at_picks_that_ref(cache):
    other = "fedcba9876543210fedcba9876543210fedcba98"
    fake_cache(cache, commit=other, ref="main")
    assert hub.resolve(f"my-org/muse-tiny-copy@{other}").name == other
    assert musecore.plan("my-org/muse-tiny-copy", device="cpu").model == "my-org/muse-tiny-copy"


def test_a_missing_snapshot_is_one_line_naming_the_fetch_command(cache, capsys):
    with pytest.raises(FileNotFoundError, match="hf download nobody/absent"):
        musecore.load("nobody/absent", device="cpu")
    assert main(["generate", "--model", "nobody/absent", "--prompt", "x", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hf download nobody/absent" in err and str(cache) in err, err


def test_download_is_refused_while_offline(cache):
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        hub.resolve("nobody/absent", download=True)


def test_hub_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / "hub"


@pytest.mark.parametrize("name, is_hub", [("org/name", True), ("org/name@v1.0", True), ("muse-tiny", False),
                                          ("./org/name", False), ("/abs/path", False), ("a/b/c", False)])
def test_what_counts_as_a_hub_id(name, is_hub):
    assert hub.looks_like_hub_id(name) is is_hub


def http_error(cls, status: int):
    import httpx
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
    return cls(f"{status} Client Error: something\nmore detail", response=response)


@pytest.mark.parametrize("error, said", [
    (lambda e: e.LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub"),
     "could not download nobody/absent: the Hub was not reachable and no snapshot is cached"),
    (lambda e: http_error(e.GatedRepoError, 403), "nobody/absent is gated on the Hub"),
    (lambda e: http_error(e.RepositoryNotFoundError, 404), "no repository nobody/absent on the Hub"),
    (lambda e: http_error(e.RevisionNotFoundError, 404), "nobody/absent has no revision 'v9'"),
    (lambda e: http_error(e.HfHubHTTPError, 500), "downloading nobody/absent@v9 failed: 500 Client Error: something;"),
], ids=["unreachable", "gated", "no-repo", "no-revision", "http"])
def test_a_failed_download_says_why_in_one_line(cache, monkeypatch, capsys, error, said):
    import huggingface_hub
    from huggingface_hub import errors

    def fail(*args, **kwargs):
        raise error(errors)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the fixture's guard; the fake never reaches the network
    hub_id = "nobody/absent@v9" if "revision" in said or "failed" in said else "nobody/absent"
    with pytest.raises(FileNotFoundError) as raised:
        hub.resolve(hub_id, download=True)
    message = str(raised.value)
    assert said in message and "\n" not in message and "pass --download" not in message, message
