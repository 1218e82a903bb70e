"""The ``musecore`` subcommands; options shared by several of them."""

QUANTIZE_DENSE_HELP = ("also convert the attention, pooler/unpooler and lm_head projections with the device's rule "
                       "for BF16 weights (INT4 g128 on xeon; a no-op where BF16 stays BF16): faster decode, more error")
