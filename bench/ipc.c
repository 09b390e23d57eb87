/* kvbench ipc: round trip of one 64-byte entry between two processes,
 * client -> kvd -> client, three ways in the same run:
 *
 *   ring        a NOP through the SQ, echoed through the CQ, both sides
 *               spinning (the client still pays its kick check);
 *   ring_sleep  the same with both sides asleep on the futex before each
 *               message: two futex wake-ups per round trip;
 *   sock        the same 64 bytes over a SOCK_SEQPACKET socketpair with
 *               blocking send / recv: the control plane's transport.
 *
 * The parent is the client and keeps the clock; the child echoes.  With two
 * CPUs or more they are pinned to different ones.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "proto/kvd_ring.h"
#include "shm/shm.h"

#define IPC_TIMEOUT_NS 10000000000ull   /* a dead peer ends the run */
#define IPC_RING       64

enum { IPC_RING_SPIN, IPC_RING_SLEEP, IPC_SOCK, IPC_NKIND };

static const char *const kind_name[IPC_NKIND] = {
	"ring, both spinning", "ring, futex sleep", "socket (SEQPACKET)",
};

struct ipc {
	struct shm_region kvd, cli;     /* the child uses kvd, the parent cli */
	int sock[2];
	int iters, warm;
};

static double now_us(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

/* The first two CPUs we may run on, or -1 when there are fewer. */
static void pick_cpus(int *a, int *b)
{
	cpu_set_t set;

	*a = *b = -1;
	if (sched_getaffinity(0, sizeof set, &set))
		return;
	for (int c = 0; c < CPU_SETSIZE; c++) {
		if (!CPU_ISSET(c, &set))
			continue;
		if (*a < 0) {
			*a = c;
		} else {
			*b = c;
			return;
		}
	}
	*a = -1;
}

static void pin(int cpu)
{
	cpu_set_t set;

	if (cpu < 0)
		return;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	sched_setaffinity(0, sizeof set, &set);
}

/* kvd's side: echo every SQ entry as a completion. */
static int echo_ring(struct shm_region *r, int n, int sleep)
{
	for (int i = 0; i < n; i++) {
		struct kvd_sqe sqe;
		struct kvd_cqe *cqe;
		int m = shm_ring_wait(&r->sq, 0, IPC_TIMEOUT_NS, !sleep);

		if (m <= 0)
			return -1;
		memcpy(&sqe, shm_ring_entry(&r->sq, 0), sizeof sqe);
		shm_ring_release(&r->sq, 1);
		cqe = shm_ring_reserve(&r->cq);
		if (!cqe)
			return -1;
		memset(cqe, 0, sizeof *cqe);
		cqe->user_data = sqe.user_data;
		cqe->res = sqe.op == KVD_OP_NOP ? 0 : -EINVAL;
		shm_ring_commit(&r->cq, 1);
		shm_ring_wake(&r->cq);
	}
	return 0;
}

static int echo_sock(int fd, int n)
{
	char buf[KVD_RING_ENTRY];

	for (int i = 0; i < n; i++) {
		if (recv(fd, buf, sizeof buf, 0) != sizeof buf ||
		    send(fd, buf, sizeof buf, MSG_NOSIGNAL) != sizeof buf)
			return -1;
	}
	return 0;
}

static void child_main(struct ipc *x, int cpu)
{
	int n = x->warm + x->iters;

	prctl(PR_SET_PDEATHSIG, SIGKILL);
	pin(cpu);
	close(x->sock[0]);
	if (echo_ring(&x->kvd, n, 0) || echo_ring(&x->kvd, n, 1) || echo_sock(x->sock[1], n))
		_exit(1);
	_exit(0);
}

/* The client's side of one round trip through the rings. */
static int ring_rtt(struct shm_region *r, uint64_t id, int sleep)
{
	struct kvd_sqe *sqe = shm_ring_reserve(&r->sq);
	const struct kvd_cqe *cqe;

	if (!sqe)
		return -1;
	memset(sqe, 0, sizeof *sqe);
	sqe->op = KVD_OP_NOP;
	sqe->user_data = id;
	shm_ring_commit(&r->sq, 1);
	shm_ring_wake(&r->sq);
	if (shm_ring_wait(&r->cq, 0, IPC_TIMEOUT_NS, !sleep) <= 0)
		return -1;
	cqe = shm_ring_entry(&r->cq, 0);
	if (cqe->user_data != id || cqe->res)
		return -1;
	shm_ring_release(&r->cq, 1);
	return 0;
}

static int sock_rtt(int fd, uint64_t id)
{
	struct kvd_sqe m = { .op = KVD_OP_NOP, .user_data = id };

	if (send(fd, &m, sizeof m, MSG_NOSIGNAL) != sizeof m ||
	    recv(fd, &m, sizeof m, 0) != sizeof m || m.user_data != id)
		return -1;
	return 0;
}

/* Fills us[iters] with one kind's round trips, after x->warm unmeasured. */
static int measure(struct ipc *x, int kind, double *us)
{
	for (int i = 0; i < x->warm + x->iters; i++) {
		double t0 = now_us();
		int err = kind == IPC_SOCK ? sock_rtt(x->sock[0], (uint64_t)i)
					   : ring_rtt(&x->cli, (uint64_t)i, kind == IPC_RING_SLEEP);

		if (err)
			return -1;
		if (i >= x->warm)
			us[i - x->warm] = now_us() - t0;
	}
	return 0;
}

static int usage(void)
{
	fprintf(stderr, "usage: kvbench ipc [--json] [--iters N]\n");
	return 2;
}

int bench_ipc_main(int argc, char **argv)
{
	struct shm_params p = { .entry_size = KVD_RING_ENTRY, .sq_entries = IPC_RING,
				.cq_entries = IPC_RING };
	double p50[IPC_NKIND], p99[IPC_NKIND], *us[IPC_NKIND] = { 0 };
	struct ipc x = { .sock = { -1, -1 }, .iters = 20000 };
	int json = 0, fd, cpu_a, cpu_b, status, failed = 0, err = 1;
	size_t size = shm_region_size(&p);
	void *mem;
	pid_t pid;

	for (int i = 0; i < argc; i++) {
		if (!strcmp(argv[i], "--json"))
			json = 1;
		else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
			x.iters = atoi(argv[++i]);
		else if (i || !strcmp(argv[i], "--iters") || argv[i][0] == '-')
			return usage();     /* a leading "ipc" is allowed */
	}
	if (x.iters < 1)
		return usage();
	x.warm = x.iters / 10 < 1000 ? x.iters / 10 : 1000;

	fd = shm_memfd_create("kvbench-ipc", size, &mem);
	if (fd < 0) {
		fprintf(stderr, "ipc: memfd: %s\n", strerror(-fd));
		return 1;
	}
	if (shm_region_create(&x.kvd, mem, &p) || shm_region_attach(&x.cli, mem, size) ||
	    socketpair(AF_UNIX, SOCK_SEQPACKET, 0, x.sock)) {
		fprintf(stderr, "ipc: setup failed\n");
		goto out;
	}
	for (int k = 0; k < IPC_NKIND; k++)
		if (!(us[k] = malloc((size_t)x.iters * sizeof *us[k])))
			goto out;
	pick_cpus(&cpu_a, &cpu_b);

	fflush(NULL);
	pid = fork();
	if (pid < 0)
		goto out;
	if (pid == 0)
		child_main(&x, cpu_b);
	pin(cpu_a);
	close(x.sock[1]);
	x.sock[1] = -1;
	for (int k = 0; k < IPC_NKIND; k++) {
		if (measure(&x, k, us[k])) {
			fprintf(stderr, "ipc: %s: round trip failed\n", kind_name[k]);
			kill(pid, SIGKILL);
			failed = 1;
			break;
		}
		p50[k] = bench_median(us[k], x.iters);     /* sorts */
		p99[k] = us[k][(size_t)(0.99 * (x.iters - 1))];
	}
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status)) {
		fprintf(stderr, "ipc: the echo process failed\n");
		failed = 1;
	}
	if (failed)
		goto out;
	err = 0;

	if (json) {
		printf("{\"bench\":\"ipc\",\"ring_rtt_us_p50\":%.3f,\"ring_rtt_us_p99\":%.3f,"
		       "\"ring_sleep_rtt_us_p50\":%.3f,\"ring_sleep_rtt_us_p99\":%.3f,"
		       "\"sock_rtt_us_p50\":%.3f,\"sock_rtt_us_p99\":%.3f,\"ratio\":%.2f,"
		       "\"iters\":%d,\"cpu\":\"%s\"}\n",
		       p50[IPC_RING_SPIN], p99[IPC_RING_SPIN], p50[IPC_RING_SLEEP],
		       p99[IPC_RING_SLEEP], p50[IPC_SOCK], p99[IPC_SOCK],
		       p50[IPC_SOCK] / p50[IPC_RING_SPIN], x.iters, bench_cpu_name());
	} else {
		printf("ipc round trip, %d-byte entry, %d iters, %s, %s\n", KVD_RING_ENTRY,
		       x.iters, bench_cpu_name(),
		       cpu_b >= 0 ? "pinned to two CPUs" : "unpinned (one CPU)");
		printf("  %-22s %9s %9s\n", "", "p50 us", "p99 us");
		for (int k = 0; k < IPC_NKIND; k++)
			printf("  %-22s %9.2f %9.2f\n", kind_name[k], p50[k], p99[k]);
		printf("  socket / spinning ring, p50: %.1fx\n",
		       p50[IPC_SOCK] / p50[IPC_RING_SPIN]);
	}
out:
	for (int k = 0; k < IPC_NKIND; k++)
		free(us[k]);
	for (int i = 0; i < 2; i++)
		if (x.sock[i] >= 0)
			close(x.sock[i]);
	munmap(mem, size);
	close(fd);
	return err;
}
