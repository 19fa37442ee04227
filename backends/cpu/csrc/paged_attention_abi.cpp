// The paged-attention kernels of paged_attention.c with C linkage (ps_paged_decode_f32,
// ps_write_kv_q8, ps_abi_version, ...), compiled into the cpu backend's one native library
// (native_ops.py) and called through ctypes by kernels.py. The file is written to be valid C and
// C++; decode_attention.cpp and fused_decode.cpp include it again in their own namespaces for the
// kernels' internal pieces.

// The kernels' system headers first, outside extern "C".
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

extern "C" {
#define restrict __restrict__
#define _Thread_local thread_local
#include "paged_attention.c"
#undef restrict
#undef _Thread_local
}
