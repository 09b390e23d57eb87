/* kvd-decode: the end-to-end decode driver.  `kvd-decode --help` and
 * docs/GPU.md say what it does; run.c does it. */
#include <stdio.h>

#include "args.h"
#include "run.h"

int main(int argc, char **argv)
{
	struct dec_args a;
	char msg[256];
	int rc;

	dec_args_default(&a);
	rc = dec_args_parse(&a, argc - 1, argv + 1, msg, sizeof msg);
	if (rc < 0) {
		fprintf(stderr, "kvd-decode: %s (try --help)\n", msg);
		return 2;
	}
	if (rc == 1) {
		dec_usage(stdout);
		return 0;
	}
#ifndef KVC_CUDA
	fprintf(stderr, "kvd-decode: no CUDA device: built without CUDA (CUDA=0)\n");
	if (a.json)
		printf("{\"bench\":\"decode\",\"attn\":\"%s\",\"skipped\":\"built without CUDA\"}\n",
		       dec_attn_name(a.attn));
	return 77;
#else
	struct dec_result r;

	rc = dec_run(&a, &r);
	if (rc == 77) {
		fprintf(stderr, "kvd-decode: no CUDA device: %s\n", r.err);
		if (a.json)
			printf("{\"bench\":\"decode\",\"attn\":\"%s\",\"skipped\":\"no CUDA device\"}\n",
			       dec_attn_name(a.attn));
		return 77;
	}
	if (rc) {
		fprintf(stderr, "kvd-decode: %s\n", r.err);
		return 1;
	}
	dec_print(stdout, &a, &r, a.json);
	return 0;
#endif
}
