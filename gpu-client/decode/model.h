/* The non-attention kernels of kvd-decode's model (model.cu): random
 * weights and data, embedding, RMSNorm, RoPE, SwiGLU, casts, greedy argmax.
 * Launchers enqueue on `st` and return the launch status.  bf16 is uint16_t
 * bits (engine/bf16.h's rounding). */
#ifndef KVD_DECODE_MODEL_H
#define KVD_DECODE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* p[i] = bf16(offset + scale * u), u uniform in [-1, 1) from (seed, i). */
cudaError_t mdl_fill_bf16(uint16_t *p, size_t n, uint64_t seed, float offset, float scale,
			  cudaStream_t st);

/* x[b][:] = emb[tok[b]][:] as float. */
cudaError_t mdl_embed(const uint16_t *emb, const int32_t *tok, float *x, uint32_t B,
		      uint32_t hidden, cudaStream_t st);

/* out[b][:] = bf16(x[b][:] / rms(x[b]) * w[:]). */
cudaError_t mdl_rmsnorm(const float *x, const uint16_t *w, uint16_t *out, uint32_t B,
			uint32_t hidden, float eps, cudaStream_t st);

/* qkv [B][(Hq + 2H) * d] (q, then k, then v) into q [B][Hq][d] and k
 * [B][H][d] rotated for position pos (rotate-half, base theta), v [B][H][d]. */
cudaError_t mdl_rope_split(const float *qkv, uint32_t B, uint32_t Hq, uint32_t H, uint32_t d,
			   uint32_t pos, float theta, float *q, float *k, float *v,
			   cudaStream_t st);

/* y = bf16(x), n elements. */
cudaError_t mdl_to_bf16(const float *x, uint16_t *y, size_t n, cudaStream_t st);

/* gu [B][2 * inter] (gate, then up) into out [B][inter] = bf16(silu(g) * u). */
cudaError_t mdl_swiglu(const float *gu, uint16_t *out, uint32_t B, uint32_t inter,
		       cudaStream_t st);

/* tok[b] = argmax of logits[b][0 .. vocab) (lowest index on ties). */
cudaError_t mdl_argmax(const float *logits, uint32_t B, uint32_t vocab, int32_t *tok,
		       cudaStream_t st);

#ifdef __cplusplus
}
#endif

#endif
