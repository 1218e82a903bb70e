"""The checked vectors of FORMATS.md shared by several test modules."""

import torch

# The NVFP4 row of FORMATS.md (two 16-blocks), checked against nvidia-modelopt 0.47.0.
B0 = [0.5, -0.25, 0.125, 0.3, -0.0625, 0.0, 0.01, -0.49] + [0.2] * 8
B1 = [0.1, -0.05, 0.025, 0.0125, 0.07, -0.09, 0.0, 0.03] + [0.04] * 8
FORMATS_MD_ROW = torch.tensor([B0 + B1], dtype=torch.float32)
