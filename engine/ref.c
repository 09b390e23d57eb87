#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lsh.h"
#include "ref.h"

static double dot(const float *a, const float *b, int d)
{
	double acc = 0.0;

	for (int e = 0; e < d; e++)
		acc += (double)a[e] * b[e];
	return acc;
}

/* Two passes over the weights so the max is exact. */
void kvd_ref_softmax_v(const float *v, int d, const uint32_t *idx, size_t m, const double *w,
		       double *o, double *lse)
{
	double mx = -INFINITY, sum = 0.0;

	memset(o, 0, (size_t)d * sizeof *o);
	for (size_t i = 0; i < m; i++)
		mx = w[i] > mx ? w[i] : mx;
	if (m == 0 || mx == -INFINITY) {
		*lse = -INFINITY;
		return;
	}
	for (size_t i = 0; i < m; i++) {
		const float *vi = v + (idx ? idx[i] : i) * (size_t)d;
		double e = exp(w[i] - mx);

		sum += e;
		for (int j = 0; j < d; j++)
			o[j] += e * vi[j];
	}
	for (int j = 0; j < d; j++)
		o[j] /= sum;
	*lse = mx + log(sum);
}

static void scores(const float *q, int d, const float *k, const uint32_t *idx, size_t m,
		   int K, int L, int c, double *w)
{
	double qn = sqrt(dot(q, q, d)), scale = 1.0 / sqrt((double)d);

	for (size_t i = 0; i < m; i++) {
		const float *ki = k + (idx ? idx[i] : i) * (size_t)d;
		double s = dot(q, ki, d);

		w[i] = s * scale;
		if (K) {
			double kn = sqrt(dot(ki, ki, d));
			double cs = qn > 0 && kn > 0 ? s / (qn * kn) : 0.0;

			w[i] -= kvd_lsh_logp(cs, K, L, c);
		}
	}
}

static void run(const float *q, int d, const float *k, const float *v, const uint32_t *idx,
		size_t m, int K, int L, int c, double *o, double *lse)
{
	double *w = malloc((m ? m : 1) * sizeof *w);

	if (!w) {
		/* Reference code for tests: failing loudly beats a silent answer. */
		abort();
	}
	scores(q, d, k, idx, m, K, L, c, w);
	kvd_ref_softmax_v(v, d, idx, m, w, o, lse);
	free(w);
}

void kvd_ref_dense(const float *q, int d, const float *k, const float *v,
		   const uint32_t *idx, size_t m, double *o, double *lse)
{
	run(q, d, k, v, idx, m, 0, 0, 0, o, lse);
}

void kvd_ref_sampled(const float *q, int d, const float *k, const float *v,
		     const uint32_t *idx, size_t m, int K, int L, int c,
		     double *o, double *lse)
{
	run(q, d, k, v, idx, m, K, L, c, o, lse);
}

void kvd_ref_merge(double *o, double *lse, const double *o2, double lse2, int d)
{
	if (lse2 == -INFINITY)
		return;
	if (*lse == -INFINITY) {
		memcpy(o, o2, (size_t)d * sizeof *o);
		*lse = lse2;
		return;
	}
	double mx = *lse > lse2 ? *lse : lse2;
	double wa = exp(*lse - mx), wb = exp(lse2 - mx);

	for (int j = 0; j < d; j++)
		o[j] = (wa * o[j] + wb * o2[j]) / (wa + wb);
	*lse = mx + log(wa + wb);
}
