/* kvbench's scenes against a real kvd: the daemon, the model, the client
 * processes.  See srv.h. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "srv.h"
#include "tests/integration/daemon.h"

int srv_start_conf(struct daemon *s, const char *memory, const char *extra)
{
	return srv_start_threads(s, 0, memory, extra);
}

int srv_start_threads(struct daemon *s, unsigned threads, const char *memory, const char *extra)
{
	char conf[sizeof s->dir + 16];
	const char *args[] = { "--config", conf, NULL };
	FILE *f;

	if (daemon_mkdir(s, "/tmp/kvd-run.XXXXXX"))
		return -1;
	snprintf(conf, sizeof conf, "%s/kvd.conf", s->dir);
	f = fopen(conf, "w");
	if (!f)
		return -1;
	/* The default configuration, written out so the demo shows one. */
	fprintf(f, "[server]\nsocket = %s\nthreads = %u\n\n[memory]\n%s\n\n"
		   "[transport]\nslots = 16\nslot_size = 4M\nring_entries = 256\nspin_us = 50\n\n"
		   "[log]\nlevel = warning\n%s", s->sock, threads, memory ? memory : "limit = 75%",
		extra ? extra : "");
	fclose(f);
	return daemon_spawn(s, "kvd", args);
}

static const uint32_t llama_dense[] = { 0, 16 };

struct kvc_model llama(uint32_t layers)
{
	return (struct kvc_model){
		.name = layers == 32 ? "llama-3.1-8b" : "llama-3.1-8b-slice", .layers = layers,
		.q_heads = 32, .kv_heads = 8, .head_dim = 128, .K = 10, .L = 150, .c = 2,
		.sink = 4, .window = 64, .dense_layers = llama_dense,
		.n_dense = layers == 32 ? 2 : 0, .seed = 1,
	};
}

void *shared_mem(size_t bytes)
{
	void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED) {
		perror("kvbench: mmap");
		return NULL;
	}
	return p;
}

int run_clients_mid(uint32_t n, int (*kid)(uint32_t i, void *arg), void (*mid)(void *arg),
		    void *arg)
{
	pid_t *pids = calloc(n ? n : 1, sizeof *pids);
	int failed = !pids;

	for (uint32_t i = 0; pids && i < n; i++) {
		pids[i] = fork();
		if (pids[i] == 0)
			_exit(kid(i, arg) ? 1 : 0);
		if (pids[i] < 0) {
			n = i;
			failed = 1;
			break;
		}
	}
	if (!failed && mid)
		mid(arg);
	for (uint32_t i = 0; pids && i < n; i++) {
		int st;

		waitpid(pids[i], &st, 0);
		failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
	}
	free(pids);
	return failed;
}

int run_clients(uint32_t n, int (*kid)(uint32_t i, void *arg), void *arg)
{
	return run_clients_mid(n, kid, NULL, arg);
}
