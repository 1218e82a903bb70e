"""Media for multimodal prompts: images, video and audio -> the inputs of the vision and audio towers.

Reproduces transformers 5.24's Muse Spark processors (``MuseGlimmerImageProcessor``,
``MuseGlimmerVideoProcessor``, ``MuseSparkFeatureExtractor``, ``MuseSparkProcessor``) without
torchvision or torchaudio: Pillow decodes images, PyAV video, soundfile audio (the ``media``
extra: ``pip install "musecore[media]"``); everything else is plain torch. Bad media raises
:class:`MediaError` with one line naming the input and what to do.

Example::

    from musecore.media import MediaProcessor, load_image, load_audio
    processor = MediaProcessor.from_pretrained("musecore/data/muse-tiny")
    images = processor.images([load_image("cat.png")])      # pixel_values [P, 1176], grid_thw [1, 3]
    text = processor.placeholder("image", images, 0)        # "<|image_start|><|image|>...<|image_end|>"
    audio = processor.audio([load_audio("speech.wav")])     # input_values [1, L], mask [1, L]
"""

from .audio import AudioInputs, AudioSettings, load_audio, process_audio, resample
from .errors import MediaError
from .image import MAX_PIXELS, ImageInputs, ImageSettings, load_image, process_images, smart_resize
from .processor import TOKEN_DEFAULTS, MediaProcessor
from .video import Video, VideoInputs, VideoSettings, load_video, process_videos, sample_frame_indices

__all__ = [
    "MediaError", "MediaProcessor", "TOKEN_DEFAULTS", "MAX_PIXELS",
    "load_image", "load_video", "load_audio",
    "ImageInputs", "VideoInputs", "AudioInputs", "Video",
    "ImageSettings", "VideoSettings", "AudioSettings",
    "process_images", "process_videos", "process_audio", "resample", "smart_resize", "sample_frame_indices",
]
