/* The native kernels of musecore-xeon, compiled as one translation unit into one shared object (so the helpers of
   int4.c stay static inline in every part) by musecore_xeon/kernels/native.py: cc -O3 -fPIC -shared [ISA flags]
   [-fopenmp] kernels.c -lm. The parts, in this order: */
#include "int4.c"
#include "amx.c"
#include "bf16dot.c"
#include "ops.c"
#include "bf16.c"
#include "moe.c"
