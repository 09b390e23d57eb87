/* The host emulation of CUDA checks itself (docs/GPU.md, "Host emulation"):
 * each check below fails if the emulator stops doing what it claims.
 *  - a correct kernel with barriers and shuffles gives the right answer in
 *    every schedule; a missing barrier gives a wrong one in at least one;
 *  - rendezvous errors abort with a message naming the kernel: a thread
 *    exiting before a barrier, a lane missing from a shuffle, threads at
 *    different barriers, a shuffle reading a lane outside its mask;
 *  - copies are checked against the live allocations (range, direction),
 *    cudaFree of an unknown pointer aborts;
 *  - streams run lazily and in order: a host read before the wait sees the
 *    old bytes; an event wait makes the other stream's work run first; a
 *    cudaFreeAsync not ordered after a use on another stream aborts;
 *  - launch limits, the smem attribute per kernel, poisoning, and the GEMM's
 *    leading-dimension rules and result.
 * Aborting cases run in a forked child whose stderr is checked. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
extern "C" {
#include <cmocka.h>
}

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "../../gpu-client/kvg_launch.cuh"

#define CU(x) assert_int_equal((int)(x), (int)cudaSuccess)

/* ---- kernels ---------------------------------------------------------------- */

/* out[b] = sum of in[b*n .. b*n+n), through shared memory and a barrier tree,
 * then a warp shuffle reduction.  bad = 1 drops the barrier after the store. */
static __global__ void __launch_bounds__(128) sum_kernel(const float *in, float *out, int bad)
{
	KVG_DYN_SMEM(float, sh);
	unsigned t = threadIdx.x, n = blockDim.x;

	sh[t] = in[blockIdx.x * n + t];
	if (!bad)
		__syncthreads();
	float x = sh[(t + 1) % n];      /* a neighbour's value: a race without the barrier */

	for (int m = 16; m; m >>= 1)
		x += __shfl_xor_sync(0xffffffffu, x, m);
	__syncthreads();
	if (t % 32 == 0)
		sh[t / 32] = x;
	__syncthreads();
	if (t == 0) {
		float s = 0;

		for (unsigned w = 0; w < n / 32; w++)
			s += sh[w];
		out[blockIdx.x] = s;
	}
}

/* mode 1: thread 5 returns before the barrier; 2: lane 31 leaves before a
 * full-mask shuffle; 3: odd warps at another barrier; 4: shuffle reads a
 * lane outside the mask. */
static __global__ void bad_kernel(float *out, int mode)
{
	unsigned t = threadIdx.x;
	float x = (float)t;

	if (mode == 1 && t == 5)
		return;
	if (mode == 2 && t % 32 == 31)
		return;
	if (mode == 3 && (t / 32) % 2) {
		__syncthreads();
	} else if (mode == 4) {
		x = __shfl_sync(0x0000ffffu, x, 20);
	} else if (mode == 2) {
		x = __shfl_xor_sync(0xffffffffu, x, 1);
	} else {
		__syncthreads();
	}
	out[t] = x;
}

static __global__ void smem_kernel(float *out)
{
	KVG_DYN_SMEM(uint32_t, sh);

	out[threadIdx.x] = __uint_as_float(sh[threadIdx.x]);
}

static __global__ void fill_kernel(float *out, float v, int n)
{
	for (int i = threadIdx.x; i < n; i += blockDim.x)
		out[i] = v;
}

/* ---- helpers ------------------------------------------------------------------ */

/* Runs f in a child; passes when the child aborts and its stderr has want. */
static void expect_abort(void (*f)(void), const char *want)
{
	int fd[2];
	char buf[8192];
	size_t got = 0;
	ssize_t r;
	int st;

	assert_int_equal(pipe(fd), 0);
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();

	if (pid == 0) {
		dup2(fd[1], 2);
		close(fd[0]);
		f();
		fprintf(stderr, "child: no error was reported\n");
		_exit(0);
	}
	close(fd[1]);
	while (got < sizeof buf - 1 && (r = read(fd[0], buf + got, sizeof buf - 1 - got)) > 0)
		got += (size_t)r;
	buf[got] = 0;
	close(fd[0]);
	assert_int_equal(waitpid(pid, &st, 0), pid);
	if (!WIFSIGNALED(st) || !strstr(buf, want))
		fail_msg("want an abort saying \"%s\"; got status %#x, stderr:\n%s", want, st, buf);
	/* the first line of what it said, for the log */
	char *nl = strchr(buf, '\n');

	if (nl)
		*nl = 0;
	print_message("  caught: %.300s\n", buf);
}

static float *dev_floats(size_t n)
{
	void *p;

	CU(cudaMalloc(&p, n * 4));
	return (float *)p;
}

/* ---- schedules and rendezvous --------------------------------------------------- */

static int sum_run(int order, int bad)
{
	const int B = 3, N = 128;
	float in[B * N], out[B], *din = dev_floats(B * N), *dout = dev_floats(B);
	int ok = 1;

	emu_set_order(order, 7);
	for (int i = 0; i < B * N; i++)
		in[i] = (float)(i % 17) + 0.25f * (float)(i % 3);
	CU(cudaMemcpy(din, in, sizeof in, cudaMemcpyHostToDevice));
	KVG_LAUNCH(sum_kernel, B, N, N * sizeof(float), 0, din, dout, bad);
	CU(cudaGetLastError());
	CU(cudaMemcpy(out, dout, sizeof out, cudaMemcpyDeviceToHost));
	for (int b = 0; b < B; b++) {
		float want = 0;

		for (int i = 0; i < N; i++)
			want += in[b * N + i];
		/* every lane sums the 32 neighbours of its warp: the same numbers */
		ok &= fabsf(out[b] - want) < 1e-3f;
	}
	CU(cudaFree(din));
	CU(cudaFree(dout));
	return ok;
}

static void test_schedules(void **state)
{
	int saved = emu_get_order(), caught = 0;

	for (int o = EMU_ORDER_FWD; o <= EMU_ORDER_RAND; o++)
		assert_true(sum_run(o, 0));
	for (int o = EMU_ORDER_FWD; o <= EMU_ORDER_RAND; o++) {
		int ok = sum_run(o, 1);

		print_message("  missing barrier, schedule %d: %s\n", o, ok ? "not seen" : "wrong sum");
		caught += !ok;
	}
	assert_true(caught >= 2);       /* fwd and rev both expose it */
	emu_set_order(saved, 1);
}

static int g_mode;
static void bad_launch(void)
{
	float *d = dev_floats(128);

	KVG_LAUNCH(bad_kernel, 1, 128, 0, 0, d, g_mode);
	cudaStreamSynchronize(0);
}

static void test_rendezvous_errors(void **state)
{
	g_mode = 1;
	expect_abort(bad_launch, "exited while threads");
	g_mode = 2;
	expect_abort(bad_launch, "a lane in the mask is missing");
	g_mode = 3;
	expect_abort(bad_launch, "different __syncthreads");
	g_mode = 4;
	expect_abort(bad_launch, "which mask 0x0000ffff leaves out");
	/* and each message names the kernel */
	g_mode = 1;
	expect_abort(bad_launch, "kernel bad_kernel");
}

/* ---- memory checks ----------------------------------------------------------------- */

static void overrun_h2d(void)
{
	float h[65] = { 0 }, *d = dev_floats(64);

	cudaMemcpy(d, h, sizeof h, cudaMemcpyHostToDevice);
}
static void wrong_kind(void)
{
	float h[4] = { 0 }, *d = dev_floats(4);

	cudaMemcpy(h, d, sizeof h, cudaMemcpyHostToDevice);     /* swapped */
}
static void host_as_device(void)
{
	float h[4], h2[4] = { 0 };

	cudaMemcpy(h, h2, sizeof h, cudaMemcpyDeviceToHost);
}
static void free_unknown(void)
{
	static float x[4];

	cudaFree(x);
}
static void free_inside(void)
{
	float *d = dev_floats(8);

	cudaFree(d + 1);
}
static void memset_overrun(void)
{
	float *d = dev_floats(8);

	cudaMemsetAsync((char *)d + 16, 0, 17, 0);
}
static void use_after_free(void)
{
	float h[4] = { 0 }, *d = dev_floats(4);

	cudaFree(d);
	cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
}

static void test_memory_checks(void **state)
{
	expect_abort(overrun_h2d, "overruns its allocation");
	expect_abort(wrong_kind, "wrong cudaMemcpyKind");
	expect_abort(host_as_device, "is not device memory");
	expect_abort(free_unknown, "not the start of a live device allocation");
	expect_abort(free_inside, "(inside one)");
	expect_abort(memset_overrun, "overruns its allocation");
	expect_abort(use_after_free, "freed");

	/* fresh device memory is poisoned, and so is shared memory */
	uint32_t h[128];
	float *d = dev_floats(128);

	CU(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
	for (int i = 0; i < 128; i++)
		assert_int_equal(h[i], 0xffffffffu);
	CU(cudaMemset(d, 0, sizeof h));
	KVG_LAUNCH(smem_kernel, 1, 128, 128 * 4, 0, d);
	CU(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
	for (int i = 0; i < 128; i++)
		assert_int_equal(h[i], 0xffffffffu);
	CU(cudaFree(d));

	/* pointer attributes: device, registered host, plain host */
	struct cudaPointerAttributes a;
	static char reg[4096];

	d = dev_floats(4);
	CU(cudaPointerGetAttributes(&a, d + 2));
	assert_int_equal(a.type, cudaMemoryTypeDevice);
	CU(cudaHostRegister(reg, sizeof reg, cudaHostRegisterDefault));
	CU(cudaPointerGetAttributes(&a, reg + 100));
	assert_int_equal(a.type, cudaMemoryTypeHost);
	CU(cudaHostUnregister(reg));
	CU(cudaPointerGetAttributes(&a, reg + 100));
	assert_int_equal(a.type, cudaMemoryTypeUnregistered);
	CU(cudaFree(d));
}

/* ---- streams ---------------------------------------------------------------------------- */

static void free_unordered(void)
{
	cudaStream_t a, b;
	cudaMemPool_t pool;
	struct cudaMemPoolProps pp;
	void *p;

	memset(&pp, 0, sizeof pp);
	pp.allocType = cudaMemAllocationTypePinned;
	pp.location.type = cudaMemLocationTypeDevice;
	cudaMemPoolCreate(&pool, &pp);
	cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
	cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
	cudaMallocFromPoolAsync(&p, 64, pool, a);
	cudaMemsetAsync(p, 0, 64, a);
	cudaFreeAsync(p, b);    /* b never waited for a */
}

static void copy_race(void)
{
	cudaStream_t a, b;
	float *d = dev_floats(64), h[64];

	cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
	cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
	cudaMemsetAsync(d, 0, sizeof h, a);
	cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, b);
}

static void test_streams(void **state)
{
	cudaStream_t a, b;
	cudaEvent_t e, t0, t1;
	static float h[64];     /* registered (pinned): copies into it are asynchronous */
	float *d = dev_floats(64), p[64];
	float ms;

	CU(cudaHostRegister(h, sizeof h, cudaHostRegisterDefault));

	CU(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
	CU(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
	CU(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
	CU(cudaEventCreate(&t0));
	CU(cudaEventCreate(&t1));

	/* lazy: nothing has run until the host waits */
	for (int i = 0; i < 64; i++)
		h[i] = -1.0f;
	CU(cudaEventRecord(t0, a));
	KVG_LAUNCH(fill_kernel, 1, 32, 0, a, d, 3.0f, 64);
	CU(cudaGetLastError());
	CU(cudaEventRecord(e, a));
	CU(cudaStreamWaitEvent(b, e, 0));
	CU(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, b));
	CU(cudaEventRecord(t1, b));
	assert_true(h[0] == -1.0f && h[63] == -1.0f);
	assert_int_equal(cudaEventElapsedTime(&ms, t0, t1), cudaErrorNotReady);
	/* waiting for b runs a's kernel first (the event), then the copy */
	CU(cudaStreamSynchronize(b));
	for (int i = 0; i < 64; i++)
		assert_true(h[i] == 3.0f);
	CU(cudaEventSynchronize(t0));
	CU(cudaEventElapsedTime(&ms, t0, t1));
	assert_true(ms >= 0.0f);
	assert_int_equal(cudaEventElapsedTime(&ms, e, t1), cudaErrorInvalidResourceHandle);

	/* in order on one stream: the later fill wins */
	KVG_LAUNCH(fill_kernel, 1, 64, 0, a, d, 1.0f, 64);
	KVG_LAUNCH(fill_kernel, 1, 64, 0, a, d, 2.0f, 64);
	CU(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, a));
	CU(cudaStreamSynchronize(a));
	assert_true(h[17] == 2.0f);

	/* pageable memory, as in CUDA: an H2D copy takes the bytes when called,
	 * a D2H copy is done when it returns */
	for (int i = 0; i < 64; i++)
		p[i] = 5.0f;
	CU(cudaMemcpyAsync(d, p, sizeof p, cudaMemcpyHostToDevice, a));
	p[9] = 6.0f;
	CU(cudaMemcpyAsync(p, d, sizeof p, cudaMemcpyDeviceToHost, a));
	assert_true(p[9] == 5.0f);

	CU(cudaHostUnregister(h));
	CU(cudaEventDestroy(e));
	CU(cudaEventDestroy(t0));
	CU(cudaEventDestroy(t1));
	CU(cudaStreamDestroy(a));
	CU(cudaStreamDestroy(b));
	CU(cudaFree(d));

	expect_abort(free_unordered, "is not ordered after its use");
	expect_abort(copy_race, "nothing ordering the two");
}

/* ---- launch limits ------------------------------------------------------------------------ */

static __global__ void big_smem_kernel(float *out)
{
	KVG_DYN_SMEM(float, sh);

	sh[0] = 1.0f;
	if (threadIdx.x == 0)
		out[0] = sh[0];
}

static void test_launch_limits(void **state)
{
	float *d = dev_floats(2048);

	KVG_LAUNCH(fill_kernel, 1, 1025, 0, 0, d, 1.0f, 1);
	assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
	KVG_LAUNCH(fill_kernel, dim3(1, 65536), 32, 0, 0, d, 1.0f, 1);
	assert_int_equal(cudaGetLastError(), cudaErrorInvalidConfiguration);
	assert_int_equal(cudaGetLastError(), cudaSuccess);      /* read and cleared */
	/* > 48 KiB of dynamic smem needs the attribute, for that kernel only */
	KVG_LAUNCH(big_smem_kernel, 1, 32, 60 << 10, 0, d);
	assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
	CU(cudaFuncSetAttribute(big_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
				60 << 10));
	KVG_LAUNCH(big_smem_kernel, 1, 32, 60 << 10, 0, d);
	CU(cudaGetLastError());
	KVG_LAUNCH(smem_kernel, 1, 32, 60 << 10, 0, d);
	assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
	KVG_LAUNCH(big_smem_kernel, 1, 32, 61 << 10, 0, d);
	assert_int_equal(cudaGetLastError(), cudaErrorInvalidValue);
	assert_int_equal(cudaFuncSetAttribute(big_smem_kernel,
					      cudaFuncAttributeMaxDynamicSharedMemorySize,
					      (227 << 10) + 1),
			 cudaErrorInvalidValue);
	CU(cudaStreamSynchronize(0));
	CU(cudaFree(d));
}

/* ---- cuBLAS --------------------------------------------------------------------------------- */

static void test_gemm(void **state)
{
	cublasHandle_t h;
	const int m = 5, n = 3, k = 4, lda = 7, ldb = 4, ldc = 6;
	float A[lda * k], B[ldb * n], C[ldc * n], one = 1.0f, zero = 0.0f;
	float *dA = dev_floats(lda * k), *dB = dev_floats(ldb * n), *dC = dev_floats(ldc * n);

	for (int i = 0; i < lda * k; i++)
		A[i] = (float)(i % 5) - 2.0f;
	for (int i = 0; i < ldb * n; i++)
		B[i] = 0.5f * (float)(i % 7);
	CU(cudaMemcpy(dA, A, sizeof A, cudaMemcpyHostToDevice));
	CU(cudaMemcpy(dB, B, sizeof B, cudaMemcpyHostToDevice));
	assert_int_equal(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
	/* leading dimensions below the rows as stored */
	assert_int_equal(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F,
				      m - 1, dB, CUDA_R_32F, ldb, &zero, dC, CUDA_R_32F, ldc,
				      CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
			 CUBLAS_STATUS_INVALID_VALUE);
	assert_int_equal(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F,
				      lda, dB, CUDA_R_32F, k - 1, &zero, dC, CUDA_R_32F, ldc,
				      CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
			 CUBLAS_STATUS_INVALID_VALUE);
	assert_int_equal(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F,
				      lda, dB, CUDA_R_32F, ldb, &zero, dC, CUDA_R_32F, m - 1,
				      CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
			 CUBLAS_STATUS_INVALID_VALUE);
	/* C is poisoned (NaN): beta = 0 must not read it */
	assert_int_equal(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, dA, CUDA_R_32F,
				      lda, dB, CUDA_R_32F, ldb, &zero, dC, CUDA_R_32F, ldc,
				      CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
			 CUBLAS_STATUS_SUCCESS);
	CU(cudaMemcpy(C, dC, sizeof C, cudaMemcpyDeviceToHost));
	for (int j = 0; j < n; j++)
		for (int i = 0; i < m; i++) {
			double want = 0;

			for (int p = 0; p < k; p++)
				want += (double)A[p * lda + i] * B[j * ldb + p];
			assert_true(fabs(C[j * ldc + i] - want) < 1e-5);
		}
	assert_int_equal(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
	CU(cudaFree(dA));
	CU(cudaFree(dB));
	CU(cudaFree(dC));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_schedules),
		cmocka_unit_test(test_rendezvous_errors),
		cmocka_unit_test(test_memory_checks),
		cmocka_unit_test(test_streams),
		cmocka_unit_test(test_launch_limits),
		cmocka_unit_test(test_gemm),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
