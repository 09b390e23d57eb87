/* Host emulation of the CUDA runtime: the C API, and in C++ the device side
 * (qualifiers, dim3, threadIdx..., intrinsics, launches) of emu_kernel.h. */
#ifndef EMU_CUDA_RUNTIME_H
#define EMU_CUDA_RUNTIME_H

#include "cuda_runtime_api.h"

#ifdef __cplusplus
#include "emu_kernel.h"
#endif

#endif
