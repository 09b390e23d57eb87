/* kvg_hash: SimHash codes on the GPU, a cuBLAS GEMM then the pack kernel.
 * See kvg_kern.h. */
#include <errno.h>
#include <stdio.h>

#include <cublas_v2.h>

#include "kvg_kern.h"

int kvg_hash_rows(struct cublasContext *blas, const float *W, uint32_t d, uint32_t K, uint32_t L,
		  const float *x, uint32_t R, float *y, uint32_t rows_max,
		  const struct kvg_code_layout *lay, uint16_t *codes, cudaStream_t st, char *err,
		  size_t errlen)
{
	const float one = 1.0f, zero = 0.0f;
	const int KL = (int)(K * L);
	cublasStatus_t bs = cublasSetStream(blas, st);

	if (bs != CUBLAS_STATUS_SUCCESS)
		goto blas_fail;
	for (uint32_t r0 = 0; r0 < R; r0 += rows_max) {
		uint32_t n = R - r0 < rows_max ? R - r0 : rows_max;
		cudaError_t ce;

		/* Column-major: y^T [KL x n] = W^T-as-stored [KL x d] . x^T [d x n]
		 * (W row-major [d][KL] is W^T column-major with ld KL). */
		bs = cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, KL, (int)n, (int)d, &one, W,
				  CUDA_R_32F, KL, x + (size_t)r0 * d, CUDA_R_32F, (int)d, &zero, y,
				  CUDA_R_32F, KL, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
		if (bs != CUBLAS_STATUS_SUCCESS)
			goto blas_fail;
		ce = kvg_pack(y, r0, n, K, L, lay, codes, st);
		if (ce != cudaSuccess) {
			snprintf(err, errlen, "pack kernel: %s", cudaGetErrorString(ce));
			return -EIO;
		}
	}
	return 0;
blas_fail:
	snprintf(err, errlen, "cuBLAS: %s", cublasGetStatusString(bs));
	return -EIO;
}
