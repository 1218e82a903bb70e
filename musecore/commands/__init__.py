"""The ``musecore`` subcommands; options shared by several of them."""

QUANTIZE_DENSE_HELP = ("also convert the attention, pooler/unpooler and lm_head projections (or only the ones named, "
                       "comma-separated, e.g. --quantize-dense lm_head) with the device's rule for BF16 weights "
                       "(INT4 g128 on xeon; a no-op where BF16 stays BF16): faster decode, more error")


def add_quantize_dense(parser) -> None:
    """``--quantize-dense [GROUPS]``: True without a value, else the comma-separated group names."""
    parser.add_argument("--quantize-dense", nargs="?", const=True, default=False, metavar="GROUPS",
                        help=QUANTIZE_DENSE_HELP)
