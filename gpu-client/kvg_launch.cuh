/* Kernel launches and dynamic shared memory go through these two macros so
 * that kvg_kern.cu builds unchanged under nvcc and, with KVG_EMU defined, as
 * host C++ against the emulated runtime of tests/emu (docs/GPU.md), where a
 * launch runs every thread of a block as a fiber and a block's dynamic shared
 * memory is a poisoned host buffer.  The emulated launch gets the kernel
 * itself (cudaFuncSetAttribute's limits are per kernel) and its arguments,
 * evaluated now as a real launch evaluates them: the emulated launch runs
 * later, when its stream is waited for.
 *   KVG_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)
 *   KVG_DYN_SMEM(type, name);   declares `name`, the block's dynamic smem */
#ifndef KVG_LAUNCH_CUH
#define KVG_LAUNCH_CUH

#ifdef KVG_EMU
#include "emu_kernel.h"
#define KVG_LAUNCH(kern, grid, block, smem, st, ...)                                   \
	emu_launch(dim3(grid), dim3(block), (size_t)(smem), (st), #kern, kern, __VA_ARGS__)
#define KVG_DYN_SMEM(type, name) type *name = (type *)emu_dyn_smem()
#else
#define KVG_LAUNCH(kern, grid, block, smem, st, ...)                                   \
	kern<<<(grid), (block), (smem), (st)>>>(__VA_ARGS__)
#define KVG_DYN_SMEM(type, name) extern __shared__ __align__(16) type name[]
#endif

#endif
