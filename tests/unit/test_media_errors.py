"""Bad media gets one MediaError line that names the input and says what to do, never a traceback.

Every case is generated in tmp: missing paths, directories, empty and corrupt files, truncated
images, an image above the pixel budget (a PNG header claiming 9000 x 9000), URLs while offline,
bad base64, zero-length audio, a file of the wrong kind, arrays of the wrong shape or dtype, and
the media packages missing (musecore itself must still import).
"""

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL", reason="the media extra (pillow) is not installed")
sf = pytest.importorskip("soundfile", reason="the media extra (soundfile) is not installed")
pytest.importorskip("av", reason="the media extra (av) is not installed")

from musecore.media import MediaError, MediaProcessor, load_audio, load_image, load_video, process_audio  # noqa: E402
from musecore.media.errors import require  # noqa: E402


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (no pixel data): Pillow reads the size without decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


@pytest.fixture
def files(tmp_path: Path) -> Path:
    from PIL import Image
    (tmp_path / "empty.png").write_bytes(b"")
    junk = np.random.default_rng(0)  # fixed junk: os.urandom's made PyAV find a stream-less container ~1 in 300 runs
    (tmp_path / "junk.png").write_bytes(junk.bytes(600))
    (tmp_path / "folder").mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 60, 3), dtype=np.uint8)).save(tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "truncated.png").write_bytes(data[:len(data) // 2])
    (tmp_path / "huge.png").write_bytes(png_header(9000, 9000))
    sf.write(str(tmp_path / "zero.wav"), np.zeros(0), 16000)
    sf.write(str(tmp_path / "ok.wav"), np.zeros(100), 16000)
    (tmp_path / "junk.wav").write_bytes(junk.bytes(1000))
    (tmp_path / "junk.mp4").write_bytes(junk.bytes(3000))
    (tmp_path / "text.mp4").write_text("not a video\n" * 40)
    return tmp_path


def one_line_error(call, *args, match: str, **kwargs) -> str:
    with pytest.raises(MediaError, match=match) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and message.strip() == message, message
    return message


@pytest.mark.parametrize("load,name", [(load_image, "x.png"), (load_video, "x.mp4"), (load_audio, "x.wav")])
def test_a_missing_path_is_named(files, load, name):
    message = one_line_error(load, files / name, match="does not exist; check the path")
    assert str(files / name) in message


@pytest.mark.parametrize("load,kind", [(load_image, "an image"), (load_video, "a video"), (load_audio, "an audio")])
def test_a_directory_is_refused(files, load, kind):
    one_line_error(load, files / "folder", match=f"is a directory; pass the path of {kind} file")


@pytest.mark.parametrize("load", [load_image, load_video, load_audio])
@pytest.mark.parametrize("url", ["http://example.com/a", "https://example.com/a", "HTTPS://EXAMPLE.COM/A"])
def test_urls_are_refused_offline_with_what_to_do(load, url):
    one_line_error(load, url, match="is an http\\(s\\) URL; musecore runs offline and does not download media: "
                                    "save the file and pass its local path")


@pytest.mark.parametrize("load", [load_image, load_video, load_audio])
def test_empty_files_and_bytes_are_refused(files, load):
    one_line_error(load, files / "empty.png", match="empty.png is empty \\(0 bytes\\)")
    one_line_error(load, b"", match="bytes is empty \\(0 bytes\\)")


def test_corrupt_and_truncated_images(files):
    one_line_error(load_image, files / "junk.png", match="junk.png is not an image Pillow recognises")
    one_line_error(load_image, files / "truncated.png", match="truncated.png is corrupt or truncated")
    one_line_error(load_image, b"hello", match="image bytes is not an image")


def test_an_image_above_the_pixel_budget_states_budget_and_size(files):
    one_line_error(load_image, files / "huge.png",
                   match="huge.png is 9000x9000 \\(81,000,000 pixels\\), above the pixel budget of 67,108,864 pixels")
    one_line_error(load_image, files / "ok.png", max_pixels=1000,
                   match="ok.png is 60x60 \\(3,600 pixels\\), above the pixel budget of 1,000 pixels")
    one_line_error(load_image, png_header(20000, 20000), match="above the pixel budget")   # past Pillow's own limit


def test_bad_data_urls(files):
    one_line_error(load_image, "data:image/png;base64,@@@", match="data:image/png URL: the base64 data does not decode")
    one_line_error(load_image, "data:image/png;base64", match="without a ',' before its payload")
    one_line_error(load_image, "data:image/png;base64,", match="empty payload")
    one_line_error(load_image, "ftp://host/a.png", match="'ftp://' URLs are not supported")


def test_wrong_image_arrays_and_types():
    one_line_error(load_image, np.zeros((4, 4, 3), np.float32), match="float32 array; pass uint8 values")
    one_line_error(load_image, np.zeros((4, 4, 2), np.uint8), match="has shape \\(4, 4, 2\\)")
    one_line_error(load_image, 12, match="image input: expected a path, bytes, data: URL, PIL image or uint8 array")
    one_line_error(load_image, np.zeros((0, 4, 3), np.uint8), match="has no pixels")


def test_bad_audio(files):
    one_line_error(load_audio, files / "zero.wav", match="zero.wav has no samples \\(zero length\\)")
    one_line_error(load_audio, np.zeros(0, np.float32), match="audio array has no samples")
    one_line_error(load_audio, files / "junk.wav",
                   match="junk.wav cannot be decoded .*corrupt or an unsupported format")
    one_line_error(load_audio, files / "ok.png", match="ok.png has no audio stream")
    one_line_error(load_audio, np.zeros((2, 10)), match="shape \\(2, 10\\); pass a 1-D mono waveform")
    one_line_error(load_audio, np.array([np.nan], np.float32), match="NaN or infinite")
    one_line_error(load_audio, np.zeros(10, np.uint8), match="dtype torch.uint8")
    one_line_error(load_audio, {"format": "wav"}, match="needs a 'data' key")
    one_line_error(load_audio, {"data": "!!!", "format": "wav"}, match="base64 data does not decode")
    one_line_error(load_audio, files / "ok.wav", sampling_rate=8000, match="is 16000 Hz but sampling_rate=8000")
    one_line_error(process_audio, [torch.zeros(0)], match="audio #1 has no samples")


def test_bad_video(files):
    one_line_error(load_video, files / "junk.mp4", match="junk.mp4 cannot be decoded: .*corrupt or an unsupported "
                                                         "codec/container: re-encode it as H.264 MP4")
    one_line_error(load_video, files / "text.mp4", match="text.mp4 cannot be decoded")
    one_line_error(load_video, files / "ok.wav", match="ok.wav has no video stream")
    one_line_error(load_video, np.zeros((0, 4, 4, 3), np.uint8), match="has no frames")
    one_line_error(load_video, np.zeros((2, 4, 4), np.uint8), match="pass uint8 \\[frames, height, width, 3\\]")
    one_line_error(load_video, [], match="empty list")
    one_line_error(MediaProcessor().videos, [np.zeros((2, 4, 4), np.uint8)], match="video #1 has shape")


def test_a_missing_media_package_says_how_to_install():
    one_line_error(require, "musecore_no_such_media_package", match='pip install "musecore\\[media\\]"')


def test_musecore_imports_without_the_media_packages_and_says_what_to_install():
    code = (
        "import sys\n"
        "for name in ('PIL', 'av', 'soundfile'): sys.modules[name] = None\n"
        "import musecore, musecore.media as media\n"
        "for load, src in ((media.load_image, b'x'), (media.load_video, b'x'), (media.load_audio, b'x')):\n"
        "    try:\n"
        "        load(src)\n"
        "    except media.MediaError as exc:\n"
        "        print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and all('pip install "musecore[media]"' in line for line in lines), out.stdout
    assert "'pillow'" in lines[0] and "'av'" in lines[1] and "'soundfile'" in lines[2]


def test_a_bare_base64_string_is_read_as_transformers_reads_it(files):
    import base64
    text = base64.b64encode((files / "ok.png").read_bytes()).decode()
    assert np.array_equal(np.asarray(load_image(text)), np.asarray(load_image(files / "ok.png")))
    one_line_error(load_image, "A" * 100, match="image string \\(no such file, so read as base64\\) is not an image")
    one_line_error(load_image, "photos/cat.png", match="photos/cat.png does not exist")
