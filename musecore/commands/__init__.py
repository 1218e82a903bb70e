"""The ``musecore`` subcommands; options shared by several of them."""

QUANTIZE_DENSE_HELP = ("convert the attention, pooler/unpooler and lm_head projections (or only the ones named, "
                       "comma-separated, e.g. --quantize-dense lm_head) with the device's rule for BF16 weights "
                       "(INT4 g128 on xeon; a no-op where BF16 stays BF16): faster decode, more error. Without this "
                       "option or --no-quantize-dense the device chooses: xeon and xeon6 convert all three")


def add_quantize_dense(parser) -> None:
    """``--quantize-dense [GROUPS]`` (True without a value, else the comma-separated group names) and
    ``--no-quantize-dense`` (False); neither: None, the device's default."""
    parser.add_argument("--quantize-dense", nargs="?", const=True, default=None, metavar="GROUPS",
                        help=QUANTIZE_DENSE_HELP)
    parser.add_argument("--no-quantize-dense", dest="quantize_dense", action="store_const", const=False,
                        help="keep the attention, pooler/unpooler and lm_head projections as the checkpoint has "
                             "them (MODEL.md's plan: only the routed experts are converted)")


DEFAULT_MODEL = "muse-tiny"


def add_model(parser) -> None:
    """What to load and where, for the commands that run a model: ``--model``, ``--device``, ``--emulate``,
    ``--quantize-dense`` / ``--no-quantize-dense`` and ``--download``."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"checkpoint folder, Hub id (org/name, from the local Hugging Face cache) or preset name "
                             f"(default: {DEFAULT_MODEL}, the bundled model)")
    parser.add_argument("--device", default="auto", help="device profile or torch device (default: auto)")
    parser.add_argument("--emulate", action="store_true",
                        help="run the device's numerics with reference kernels on this machine")
    add_quantize_dense(parser)
    add_download(parser)


def add_sampling(parser) -> None:
    """``--temperature``, ``--top-p``, ``--top-k`` and ``--seed``, as ``model.generate`` takes them."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default: 1)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest, 0 = off (default: 0)")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (same seed, same text)")


def add_download(parser) -> None:
    """``--download``: fetch a Hub id's snapshot when the local Hugging Face cache lacks it."""
    parser.add_argument("--download", action="store_true",
                        help="when --model is a Hub id (org/name) missing from the local Hugging Face cache, "
                             "download it (never done otherwise; refused while HF_HUB_OFFLINE is set)")


def add_mesh(parser) -> None:
    """``--tp N --ep N --sp``: split the model across the ranks of a ``torchrun`` launch."""
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help="tensor parallel over N ranks (1 or the number of ranks; start them with "
                             "torchrun --nproc-per-node N -m musecore ...)")
    parser.add_argument("--ep", type=int, default=None, metavar="N",
                        help="expert parallel: the routed experts split N ways (N divides the number of ranks)")
    parser.add_argument("--sp", action="store_true",
                        help="sequence-parallel prefill: the residual stream in token shards (needs --tp > 1)")


MEDIA_KINDS = ("image", "video", "audio")


def add_media(parser, where: str) -> None:
    """``--image PATH --video PATH --audio PATH`` (each repeatable): ``args.media`` is the list of
    ``(kind, path)`` in the order given on the command line."""
    import argparse

    class AppendMedia(argparse.Action):
        def __call__(self, parser, namespace, value, option_string=None):
            items = list(getattr(namespace, "media", None) or [])
            items.append((self.const, value))
            namespace.media = items

    parser.set_defaults(media=[])
    for kind in MEDIA_KINDS:
        parser.add_argument(f"--{kind}", action=AppendMedia, const=kind, metavar="PATH", dest="media", default=[],
                            help=f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} file {where} (repeatable; all media parts "
                                 "come in command-line order, before the text; needs a checkpoint with the matching "
                                 "tower, e.g. muse-tiny-mm)")


def check_media_files(media) -> None:
    """Every ``--image/--video/--audio`` path exists, checked before the model loads."""
    from pathlib import Path

    from musecore.cli import UsageError

    for kind, path in media:
        if not Path(path).is_file():
            raise UsageError(f"--{kind} {path}: no such file; pass the path of {'an' if kind[0] in 'aeiou' else 'a'} "
                             f"{kind} file")


def media_parts(media) -> list:
    """``(kind, path)`` pairs as chat content parts."""
    return [{"type": kind, "path": path} for kind, path in media]
