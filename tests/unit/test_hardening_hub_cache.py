"""The Hugging Face cache exception of resolve_inside (issue 29, item 6): a snapshot's links are
followed into its repo's own ``blobs`` directory only; a ``blobs`` that is itself a symlink (to ``/``
or anywhere) makes no absolute link loadable."""

import json
import os

import pytest

import musecore
from musecore_quant.checkpoint import CheckpointError, open_checkpoint
from tests.helpers import random_tensors, small_config, write_checkpoint


def hub_snapshot(tmp_path, blobs_target=None):
    """A sharded checkpoint laid out as the HF cache does: ``repo/blobs/<sha>`` and
    ``repo/snapshots/rev/<name> -> ../../blobs/<sha>``. With ``blobs_target``, ``repo/blobs`` is a
    symlink to that folder (where the files then are)."""
    config = small_config()
    built = write_checkpoint(tmp_path / "built", config, random_tensors(config), shards=2)
    repo = tmp_path / "models--org--muse"
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    store = blobs_target if blobs_target is not None else repo / "blobs"
    store.mkdir(parents=True, exist_ok=True)
    if blobs_target is not None:
        (repo / "blobs").symlink_to(blobs_target, target_is_directory=True)
    for path in sorted(built.iterdir()):
        os.replace(path, store / f"sha-{path.name}")
        os.symlink(f"../../blobs/sha-{path.name}", snapshot / path.name)
    return snapshot


def test_a_real_hub_snapshot_still_loads(tmp_path):
    snapshot = hub_snapshot(tmp_path)
    assert len(open_checkpoint(snapshot).weight_names()) > 10
    assert musecore.load(snapshot, device="cpu").plan.backend == "reference"


@pytest.mark.parametrize("where", ["root", "outside"])
def test_blobs_as_a_symlink_out_of_the_cache_makes_no_absolute_link_loadable(tmp_path, where):
    outside = tmp_path / "outside"
    snapshot = hub_snapshot(tmp_path, blobs_target=tmp_path / "elsewhere")
    # An attacker's shard anywhere on the disk, named by an absolute link of the snapshot.
    outside.mkdir()
    evil = outside / "evil.safetensors"
    first = sorted(p for p in snapshot.iterdir() if p.name.endswith(".safetensors"))[0]
    evil.write_bytes(first.read_bytes())
    for name in ("config.json", "model.safetensors.index.json"):  # kept readable whatever blobs becomes
        text = (snapshot / name).read_text()
        (snapshot / name).unlink()
        (snapshot / name).write_text(text)
    if where == "root":  # the case: blobs -> /
        (snapshot.parent.parent / "blobs").unlink()
        (snapshot.parent.parent / "blobs").symlink_to("/", target_is_directory=True)
    link = snapshot / "model-00009-of-00009.safetensors"
    link.symlink_to(evil)
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: link.name for k in index["weight_map"]}
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder .*a symlink escapes it") as e:
        open_checkpoint(snapshot)
    assert "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="a symlink escapes it"):
        musecore.plan(snapshot, device="cpu")


def test_a_link_into_a_subfolder_of_blobs_is_refused(tmp_path):
    snapshot = hub_snapshot(tmp_path)
    blobs = snapshot.parent.parent / "blobs"
    (blobs / "nested").mkdir()
    first = sorted(p for p in snapshot.iterdir() if p.name.endswith(".safetensors"))[0]
    target = blobs / "nested" / "x.safetensors"
    os.replace(first.resolve(), target)
    first.unlink()
    first.symlink_to(target)
    with pytest.raises(CheckpointError, match="a symlink escapes it"):
        open_checkpoint(snapshot)
