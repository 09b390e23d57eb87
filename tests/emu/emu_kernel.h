/* Host emulation of CUDA's device side, for kernels compiled as host C++
 * (g++ -x c++ -DKVG_EMU -Itests/emu): qualifiers, dim3, the built-in
 * indices, the intrinsics kvg_kern.cu uses, and the launch that
 * gpu-client/kvg_launch.cuh expands KVG_LAUNCH to.
 *
 * A launch is enqueued on its stream (streams run lazily, see
 * emu_runtime.cc); when it runs, every block runs its threads as fibers on
 * one host thread.  __syncthreads and the warp shuffles are rendezvous
 * points: a fiber runs until it reaches one, then the others run, in the
 * order EMU_ORDER says (fwd, rev, rand with EMU_SEED).  A rendezvous that
 * cannot complete (a thread exited, a lane missing from a shuffle, threads
 * at different barriers) aborts with a message naming the kernel. */
#ifndef EMU_KERNEL_H
#define EMU_KERNEL_H

#ifndef __cplusplus
#error "emu_kernel.h is C++ (kernels are compiled with g++ -x c++)"
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime_api.h"

/* ---- qualifiers ------------------------------------------------------------ */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

/* ---- vector types ------------------------------------------------------------ */

struct uint3 {
	unsigned x, y, z;
};

struct dim3 {
	unsigned x, y, z;
	constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
	constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

struct __attribute__((aligned(16))) uint4 {
	unsigned x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
	float x, y;
};
struct __attribute__((aligned(16))) float4 {
	float x, y, z, w;
};

static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w)
{
	return uint4{ x, y, z, w };
}
static inline float2 make_float2(float x, float y)
{
	return float2{ x, y };
}

/* The running fiber's indices (the scheduler sets them at every switch). */
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
static const int warpSize = 32;

/* ---- arithmetic intrinsics ---------------------------------------------------- */

static inline float __uint_as_float(unsigned u)
{
	float f;

	memcpy(&f, &u, 4);
	return f;
}
static inline unsigned __float_as_uint(float f)
{
	unsigned u;

	memcpy(&u, &f, 4);
	return u;
}
static inline float __int_as_float(int i)
{
	float f;

	memcpy(&f, &i, 4);
	return f;
}
static inline int __float_as_int(float f)
{
	int i;

	memcpy(&i, &f, 4);
	return i;
}

/* CUDA's min/max overloads (the device libm's; host libm does fmaf, expf...) */
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
static inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
static inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
static inline float max(float a, float b) { return fmaxf(a, b); }

/* ---- rendezvous: barrier and warp shuffles ------------------------------------- */

enum { EMU_SHFL_IDX = 0, EMU_SHFL_XOR = 1 };

void emu_syncthreads(const char *file, int line);
uint64_t emu_shfl(const char *file, int line, int kind, unsigned mask, uint64_t bits, int arg,
		  int width);

template <class T>
static inline T emu_shfl_t(const char *file, int line, int kind, unsigned mask, T v, int arg,
			   int width = 32)
{
	static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
		      "__shfl_*_sync of a type the emulation does not move");
	uint64_t bits = 0;
	T r;

	memcpy(&bits, &v, sizeof v);
	bits = emu_shfl(file, line, kind, mask, bits, arg, width);
	memcpy(&r, &bits, sizeof r);
	return r;
}

#define __syncthreads() emu_syncthreads(__FILE__, __LINE__)
#define __shfl_sync(mask, ...) emu_shfl_t(__FILE__, __LINE__, EMU_SHFL_IDX, (mask), __VA_ARGS__)
#define __shfl_xor_sync(mask, ...) emu_shfl_t(__FILE__, __LINE__, EMU_SHFL_XOR, (mask), __VA_ARGS__)

/* ---- launches ---------------------------------------------------------------------- */

/* The running block's dynamic shared memory (poisoned with 0xff bytes). */
void *emu_dyn_smem(void);

/* Enqueues fn (one thread's body) for grid x block threads on st.  args,
 * argsz: the launch's arguments, scanned for device pointers (the
 * allocations the kernel may touch, for the stream-ordering checks).  A bad
 * configuration sets the error cudaGetLastError returns, as CUDA does. */
void emu_launch_fn(dim3 grid, dim3 block, size_t smem, cudaStream_t st, const char *name,
		   const void *kernel, std::function<void()> fn, const void *args, size_t argsz);

/* KVG_LAUNCH(kernel, grid, block, smem, stream, args...): the arguments are
 * converted to the kernel's parameter types and kept now (as a launch does);
 * every thread gets its own copy of them when the launch runs. */
template <class... P, class... A>
static inline void emu_launch(dim3 grid, dim3 block, size_t smem, cudaStream_t st,
			      const char *name, void (*kernel)(P...), A &&...args)
{
	static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong argument count");
	typedef std::tuple<typename std::decay<P>::type...> Args;
	std::shared_ptr<Args> bound = std::make_shared<Args>(std::forward<A>(args)...);

	emu_launch_fn(grid, block, smem, st, name, reinterpret_cast<const void *>(kernel),
		      [bound, kernel]() { std::apply(kernel, *bound); }, bound.get(),
		      sizeof(Args));
}

/* Hooks for the emulator's own test (tests/emu/test_emu.cc). */
enum { EMU_ORDER_FWD = 0, EMU_ORDER_REV = 1, EMU_ORDER_RAND = 2 };
extern "C" void emu_set_order(int order, unsigned long long seed);
extern "C" int emu_get_order(void);

#endif
