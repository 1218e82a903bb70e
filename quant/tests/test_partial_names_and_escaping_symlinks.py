"""Destinations readers could never open, and files reached through symlinks out of the checkpoint folder.

QA found: ``convert SRC my.partial`` "succeeded" into a folder every reader takes for an unfinished
conversion; ``convert`` copied ``SRC/passwd.txt -> /etc/passwd`` into the output as a regular file; and
the reader read config.json (and hf_quant_config.json, the index) through a link out of the folder,
where shard names were already contained. Each is now refused up front with one line naming the file."""

import os

import pytest
import torch

from musecore_quant.checkpoint import CheckpointError, CheckpointWriter, open_checkpoint
from musecore_quant.cli import main
from musecore_quant.convert import convert
from test_checkpoint_helpers import muse_config, muse_tensors, write_hf_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_hf_checkpoint(tmp_path / "src", muse_tensors(), muse_config(), shards=2)


@pytest.mark.parametrize("name", ["my.partial", "out.partial-1234", "a.partial-"])
def test_a_destination_named_like_a_partial_conversion_is_refused_up_front(tmp_path, capsys, src, name):
    with pytest.raises(CheckpointError, match=r"\*\.partial"):
        CheckpointWriter(tmp_path / name, config={}, format="nvfp4")
    code = main(["convert", str(src), str(tmp_path / name), "--to", "nvfp4", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and name in err, (code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "something was written for a refused destination"


def test_names_merely_containing_partial_are_fine(tmp_path, src):
    convert(src, tmp_path / "partially-done", to="nvfp4", include=[r"experts\.0\.up_proj"], progress=False)
    assert len(open_checkpoint(tmp_path / "partially-done").weight_names()) > 0


def test_a_side_file_linking_out_of_the_source_is_refused_naming_it(tmp_path, capsys, src):
    secret = tmp_path / "outside_secret.txt"
    secret.write_text("root:x:0:0\n")
    os.symlink(secret, src / "passwd.txt")
    code = main(["convert", str(src), str(tmp_path / "out"), "--to", "nvfp4", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "passwd.txt" in err and "outside" in err, (code, err)
    assert not any(p.name.startswith("out") and p.is_dir() for p in tmp_path.iterdir()), sorted(tmp_path.iterdir())


def test_a_side_file_linking_inside_the_source_is_copied(tmp_path, src):
    (src / "notes.md").write_text("hello\n")
    os.symlink("notes.md", src / "README.md")
    convert(src, tmp_path / "out", to="nvfp4", include=[r"experts\.0\.up_proj"], progress=False)
    copied = tmp_path / "out" / "README.md"
    assert not copied.is_symlink() and copied.read_text() == "hello\n"


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json", "model.safetensors.index.json"])
def test_the_reader_refuses_a_json_file_linking_out_of_the_folder(tmp_path, name):
    folder = write_hf_checkpoint(tmp_path / "ckpt", muse_tensors(), muse_config(), shards=2)
    if name == "hf_quant_config.json":
        (folder / name).write_text('{"producer": {"name": "modelopt"}, "quantization": {}}')
    outside = tmp_path / f"outside_{name}"
    os.replace(folder / name, outside)
    os.symlink(outside, folder / name)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(folder)
    message = str(info.value)
    assert name in message and "outside the checkpoint folder" in message and "\n" not in message, message


def test_an_index_entry_that_is_a_directory_is_reported_as_one(tmp_path):
    folder = write_hf_checkpoint(tmp_path / "ckpt", {"a.weight": torch.ones(2, 2), "b.weight": torch.ones(2, 2)},
                                 muse_config(), shards=2)
    shard = folder / "model-00001-of-00002.safetensors"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointError, match="is a directory, not a file"):
        open_checkpoint(folder)
