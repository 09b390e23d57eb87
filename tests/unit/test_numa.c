/* NUMA placement: kvd_numa_init describes exactly the CPUs we may use (one
 * pseudo-node on a one-node host, silently), pools made from a node's CPUs
 * run every task on them, kvd_mem_alloc_node's pages carry the node's policy
 * and lie on the node, and kvd_numa_pick spreads sequences evenly.
 *
 * On a one-node host the memory checks are still real: the policy mbind set
 * is read back with get_mempolicy(MPOL_F_ADDR), and move_pages reports the
 * node of every touched page.  The multi-node path of kvd_numa_init runs
 * against fake topologies (see "fake topologies" below) on any host. */
#include <dlfcn.h>
#include <errno.h>
#include <numa.h>
#include <numaif.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/mem.h"
#include "engine/numa_nodes.h"
#include "engine/pool.h"

#define LONG_BITS (8 * sizeof(unsigned long))

/* The calling thread's allowed CPUs, ascending; returns the count. */
static unsigned allowed(int *cpu, unsigned max)
{
	cpu_set_t set;
	unsigned n = 0;

	assert_int_equal(sched_getaffinity(0, sizeof set, &set), 0);
	for (int c = 0; c < CPU_SETSIZE && n < max; c++)
		if (CPU_ISSET(c, &set))
			cpu[n++] = c;
	return n;
}

/* Every node non-empty and ascending, nodes disjoint, their union exactly
 * the allowed CPUs; the pseudo-node when there is one node. */
static void check_covers(const struct kvd_numa *n, const int *cpu, unsigned ncpu)
{
	unsigned total = 0;

	assert_true(n->nnodes >= 1);
	assert_non_null(n->why);
	assert_int_equal(n->active, n->nnodes >= 2);
	for (unsigned i = 0; i < n->nnodes; i++) {
		const struct kvd_numa_node *nd = &n->node[i];

		assert_true(nd->ncpus >= 1);
		for (unsigned k = 0; k < nd->ncpus; k++) {
			unsigned j = 0;

			if (k)
				assert_true(nd->cpu[k] > nd->cpu[k - 1]);
			while (j < ncpu && cpu[j] != nd->cpu[k])
				j++;
			assert_true(j < ncpu);          /* an allowed CPU */
		}
		if (i)
			assert_true(nd->id > n->node[i - 1].id);
		assert_true(nd->mem == -1 || nd->mem == nd->id);
		total += nd->ncpus;
	}
	if (n->nnodes == 1) {
		assert_int_equal(n->node[0].id, -1);
		assert_int_equal(n->node[0].mem, -1);
		assert_int_equal(n->node[0].ncpus, ncpu);
		assert_memory_equal(n->node[0].cpu, cpu, ncpu * sizeof *cpu);
	} else {
		/* Disjoint ascending lists within the allowed set: the sizes
		 * adding up means the union is the allowed set. */
		assert_int_equal(total, ncpu);
	}
}

static void test_init_this_machine(void **state)
{
	static int cpu[CPU_SETSIZE];
	unsigned ncpu = allowed(cpu, CPU_SETSIZE);
	struct kvd_numa n;
	char buf[256];
	FILE *tmp = tmpfile();
	int saved = dup(STDERR_FILENO);

	/* "No warnings": nothing reaches stderr while discovering. */
	assert_non_null(tmp);
	assert_true(saved >= 0);
	fflush(stderr);
	assert_true(dup2(fileno(tmp), STDERR_FILENO) >= 0);
	int rc = kvd_numa_init(&n, 0);

	fflush(stderr);
	dup2(saved, STDERR_FILENO);
	close(saved);
	rewind(tmp);
	size_t said = fread(buf, 1, sizeof buf - 1, tmp);

	buf[said] = 0;
	fclose(tmp);
	assert_int_equal(rc, 0);
	assert_string_equal(buf, "");
	printf("numa: %u node(s), active %d (%s); libnuma %s, max node %d\n", n.nnodes,
	       n.active, n.why, numa_available() < 0 ? "unavailable" : "available",
	       numa_available() < 0 ? -1 : numa_max_node());
	check_covers(&n, cpu, ncpu);
	kvd_numa_fini(&n);
	assert_int_equal(n.nnodes, 0);
	kvd_numa_fini(&n);                      /* idempotent */

	/* max_nodes 1 forces the fallback whatever the host. */
	assert_int_equal(kvd_numa_init(&n, 1), 0);
	assert_int_equal(n.active, 0);
	assert_int_equal(n.nnodes, 1);
	check_covers(&n, cpu, ncpu);
	kvd_numa_fini(&n);

	/* max_nodes 2 caps a larger host at its first two nodes. */
	assert_int_equal(kvd_numa_init(&n, 2), 0);
	assert_true(n.nnodes >= 1 && n.nnodes <= 2);
	kvd_numa_fini(&n);
}

/* ---- pools on a node's CPUs ------------------------------------------- */

struct where {
	struct kvd_pool *p;
	const int *cpu;                 /* the CPUs the pool may use */
	unsigned ncpu;
	int bad;                        /* atomic: a task ran off its CPU */
};

static void where_task(void *arg, uint32_t t, unsigned w)
{
	struct where *x = arg;
	int c = sched_getcpu(), pinned = kvd_pool_worker_cpu(x->p, w), in = 0;

	for (unsigned k = 0; k < x->ncpu; k++)
		in |= x->cpu[k] == c;
	/* -1: kvd_pool_create's last worker, the submitter, runs where it is */
	if ((pinned >= 0 && c != pinned) || !in)
		__atomic_store_n(&x->bad, 1, __ATOMIC_RELAXED);
	/* A little work, so the job is not all taken by the first worker. */
	for (volatile int i = 0; i < 2000; i++)
		;
}

static void check_pool(unsigned nthreads, const int *cpu, unsigned ncpu)
{
	struct where x = { .cpu = cpu, .ncpu = ncpu };

	assert_int_equal(kvd_pool_create_cpus(nthreads, cpu, ncpu, &x.p), 0);
	assert_int_equal(kvd_pool_size(x.p), nthreads ? nthreads : ncpu);
	for (unsigned i = 0; i < kvd_pool_size(x.p); i++)
		assert_int_equal(kvd_pool_worker_cpu(x.p, i), cpu[i % ncpu]);
	assert_int_equal(kvd_pool_worker_cpu(x.p, kvd_pool_size(x.p)), -1);
	for (int r = 0; r < 20; r++)
		kvd_pool_run(x.p, 500, where_task, &x);
	assert_int_equal(x.bad, 0);
	kvd_pool_destroy(x.p);
}

static void test_pool_on_node(void **state)
{
	struct kvd_numa n;

	assert_int_equal(kvd_numa_init(&n, 0), 0);
	for (unsigned i = 0; i < n.nnodes; i++) {
		const struct kvd_numa_node *nd = &n.node[i];

		check_pool(0, nd->cpu, nd->ncpus);               /* one per CPU */
		check_pool(2 * nd->ncpus + 1, nd->cpu, nd->ncpus); /* round-robin */
		/* One CPU only (the node's last) while we may run on all of
		 * them: a pool that ignored the list would be caught. */
		check_pool(3, &nd->cpu[nd->ncpus - 1], 1);
	}
	kvd_numa_fini(&n);
}

static void test_pool_cpus_errors(void **state)
{
	struct kvd_pool *p = (struct kvd_pool *)&p;     /* must stay untouched */
	int neg = -1, cpu0[1];
	long conf = sysconf(_SC_NPROCESSORS_CONF);

	allowed(cpu0, 1);
	assert_int_equal(kvd_pool_create_cpus(1, NULL, 1, &p), -EINVAL);
	assert_int_equal(kvd_pool_create_cpus(1, cpu0, 0, &p), -EINVAL);
	assert_int_equal(kvd_pool_create_cpus(1, &neg, 1, &p), -EINVAL);
	assert_int_equal(kvd_pool_create_cpus(2000, cpu0, 1, &p), -EINVAL);
	/* A CPU that does not exist: the kernel refuses the pin, and a
	 * strict pool reports it rather than running unpinned. */
	if (conf > 0 && conf < 4096) {
		int none[2] = { cpu0[0], (int)conf + 7 };

		assert_true(kvd_pool_create_cpus(4, none, 2, &p) < 0);
	}
	assert_ptr_equal(p, (struct kvd_pool *)&p);
}

/* kvd_pool_create(pin) keeps pinning round-robin over the allowed CPUs. */
static void test_pool_create_pins(void **state)
{
	static int cpu[CPU_SETSIZE];
	unsigned ncpu = allowed(cpu, CPU_SETSIZE);
	struct where x = { .cpu = cpu, .ncpu = ncpu };

	assert_int_equal(kvd_pool_create(ncpu + 1, 1, &x.p), 0);
	assert_int_equal(kvd_pool_size(x.p), ncpu + 1);
	for (unsigned i = 0; i < ncpu; i++)
		assert_int_equal(kvd_pool_worker_cpu(x.p, i), cpu[i % ncpu]);
	assert_int_equal(kvd_pool_worker_cpu(x.p, ncpu), -1);
	for (int r = 0; r < 20; r++)
		kvd_pool_run(x.p, 500, where_task, &x);
	assert_int_equal(x.bad, 0);
	kvd_pool_destroy(x.p);

	assert_int_equal(kvd_pool_create(2, 0, &x.p), 0);
	assert_int_equal(kvd_pool_worker_cpu(x.p, 0), -1);
	kvd_pool_destroy(x.p);
}

/* ---- a narrowed affinity ---------------------------------------------- */

struct narrow {
	int cpu;                        /* the one CPU the thread keeps */
	int rc, active, pool_rc, pool_cpu;
	unsigned nnodes, ncpus, pool_n;
	int got;                        /* node[0].cpu[0] */
};

/* Runs on a thread of its own: sched_setaffinity(0) narrows only this
 * thread, and kvd_numa_init reads the calling thread's mask. */
static void *narrow_main(void *arg)
{
	struct narrow *r = arg;
	struct kvd_numa n;
	struct kvd_pool *p;
	cpu_set_t set;

	CPU_ZERO(&set);
	CPU_SET(r->cpu, &set);
	if (sched_setaffinity(0, sizeof set, &set) != 0) {
		r->rc = -errno;
		return NULL;
	}
	r->rc = kvd_numa_init(&n, 0);
	if (r->rc)
		return NULL;
	r->active = n.active;
	r->nnodes = n.nnodes;
	r->ncpus = n.node[0].ncpus;
	r->got = n.node[0].cpu[0];
	kvd_numa_fini(&n);
	r->pool_rc = kvd_pool_create(0, 1, &p);
	if (!r->pool_rc) {
		r->pool_n = kvd_pool_size(p);
		r->pool_cpu = kvd_pool_worker_cpu(p, 0);
		kvd_pool_destroy(p);
	}
	return NULL;
}

static void test_narrow_affinity(void **state)
{
	int cpu[CPU_SETSIZE];
	unsigned ncpu = allowed(cpu, CPU_SETSIZE);
	int pick[2] = { cpu[0], cpu[ncpu - 1] };

	for (int i = 0; i < 2; i++) {
		struct narrow r = { .cpu = pick[i] };
		pthread_t th;

		assert_int_equal(pthread_create(&th, NULL, narrow_main, &r), 0);
		pthread_join(th, NULL);
		assert_int_equal(r.rc, 0);
		assert_int_equal(r.nnodes, 1);
		assert_int_equal(r.active, 0);
		assert_int_equal(r.ncpus, 1);
		assert_int_equal(r.got, pick[i]);
		assert_int_equal(r.pool_rc, 0);
		assert_int_equal(r.pool_n, 1);
		assert_int_equal(r.pool_cpu, pick[i]);
	}
}

/* ---- memory ----------------------------------------------------------- */

/* The policy on the page at p: returns 0 and sets mode and node, or -errno. */
static int policy_at(void *p, int *mode, int *node)
{
	unsigned long mask[KVD_NUMA_MAX_NODES / LONG_BITS] = { 0 };

	if (get_mempolicy(mode, mask, KVD_NUMA_MAX_NODES + 1, p, MPOL_F_ADDR) < 0)
		return -errno;
	*node = -1;
	for (int i = 0; i < KVD_NUMA_MAX_NODES; i++)
		if ((mask[i / LONG_BITS] >> (i % LONG_BITS)) & 1) {
			*node = i;
			break;
		}
	return 0;
}

/* Touches all of p and checks every page lies on `node` (move_pages with no
 * target nodes only reports). */
static void touch_and_check(char *p, size_t bytes, int node)
{
	size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = (bytes + pg - 1) / pg;
	void **pages = malloc(n * sizeof *pages);
	int *status = malloc(n * sizeof *status);

	assert_non_null(pages);
	assert_non_null(status);
	memset(p, 0xa5, bytes);
	for (size_t i = 0; i < bytes; i += 4099)
		assert_int_equal((unsigned char)p[i], 0xa5);
	for (size_t i = 0; i < n; i++) {
		pages[i] = p + i * pg;
		status[i] = -1000;
	}
	if (move_pages(0, n, pages, NULL, status, 0) < 0) {
		printf("SKIP: move_pages: %s\n", strerror(errno));
	} else if (node >= 0) {
		for (size_t i = 0; i < n; i++)
			assert_int_equal(status[i], node);
	}
	free(pages);
	free(status);
}

static void test_mem_on_node(void **state)
{
	size_t big = 8 * KVD_MEM_HUGE + 12345;
	int mode, node, numa = numa_available() >= 0;
	struct kvd_numa n;
	char *p;

	/* Node 0 exists everywhere libnuma works: a real mbind here. */
	p = kvd_mem_alloc_node(big, 0);
	assert_non_null(p);
	assert_int_equal((uintptr_t)p % KVD_MEM_HUGE, 0);
	if (!numa) {
		printf("SKIP: libnuma unavailable, placement not checked\n");
		touch_and_check(p, big, -1);
	} else {
		int rc = policy_at(p + big - 1, &mode, &node);

		if (rc) {
			printf("SKIP: get_mempolicy: %s\n", strerror(-rc));
		} else {
			assert_int_equal(mode, MPOL_PREFERRED);
			assert_int_equal(node, 0);
		}
		touch_and_check(p, big, 0);
	}
	kvd_mem_free(p, big);

	/* No node: today's kvd_mem_alloc, default policy. */
	p = kvd_mem_alloc_node(big, -1);
	assert_non_null(p);
	if (numa && policy_at(p, &mode, &node) == 0)
		assert_int_equal(mode, MPOL_DEFAULT);
	touch_and_check(p, big, -1);
	kvd_mem_free(p, big);

	/* Small requests ignore the node; nodes the kernel refuses or that
	 * are out of range still give usable memory. */
	p = kvd_mem_alloc_node(1000, 0);
	assert_non_null(p);
	memset(p, 1, 1000);
	kvd_mem_free(p, 1000);
	for (int bad = KVD_NUMA_MAX_NODES - 1; bad <= KVD_NUMA_MAX_NODES; bad++) {
		p = kvd_mem_alloc_node(KVD_MEM_HUGE, bad);
		assert_non_null(p);
		touch_and_check(p, KVD_MEM_HUGE, -1);
		kvd_mem_free(p, KVD_MEM_HUGE);
	}

	/* Every node the daemon would use (multi-node hosts only: the
	 * pseudo-node's mem is -1). */
	assert_int_equal(kvd_numa_init(&n, 0), 0);
	for (unsigned i = 0; i < n.nnodes; i++) {
		int m = n.node[i].mem;

		if (m < 0)
			continue;
		p = kvd_mem_alloc_node(big, m);
		assert_non_null(p);
		touch_and_check(p, big, m);
		kvd_mem_free(p, big);
	}
	kvd_numa_fini(&n);
}

/* ---- fake topologies --------------------------------------------------- */

/* The host running this is likely one node, which leaves kvd_numa_init's
 * multi-node path unexercised.  So the libnuma calls it makes are
 * interposed here (a definition in the executable wins over libnuma's) and
 * answer from `fake` while it is set, forwarding to libnuma otherwise.  The
 * CPUs are the real allowed ones, so pools made from a fake node really
 * pin. */
#define FAKE_NODES 8

struct fake_node {
	int exists, mem;
	unsigned n;
	int cpu[CPU_SETSIZE];
};

static struct fake {
	int available;                  /* numa_available()'s answer */
	int max_node;
	int policy_errno;               /* get_mempolicy fails with it, if set */
	int cpus_fail;                  /* numa_node_to_cpus fails */
	int asked_missing;              /* kvd_numa asked about a missing node */
	struct fake_node node[FAKE_NODES];
} *fake;

#define REAL(name) ((__typeof__(&name))dlsym(RTLD_NEXT, #name))

int numa_available(void)
{
	return fake ? fake->available : REAL(numa_available)();
}

int numa_max_node(void)
{
	return fake ? fake->max_node : REAL(numa_max_node)();
}

int numa_bitmask_isbitset(const struct bitmask *b, unsigned i)
{
	if (fake && b == numa_nodes_ptr)
		return i < FAKE_NODES && fake->node[i].exists;
	return REAL(numa_bitmask_isbitset)(b, i);
}

int numa_node_to_cpus(int id, struct bitmask *mask)
{
	if (!fake)
		return REAL(numa_node_to_cpus)(id, mask);
	if (id < 0 || id >= FAKE_NODES || !fake->node[id].exists) {
		fake->asked_missing = 1;        /* libnuma would warn on stderr */
		return -1;
	}
	if (fake->cpus_fail)
		return -1;
	numa_bitmask_clearall(mask);
	for (unsigned k = 0; k < fake->node[id].n; k++)
		numa_bitmask_setbit(mask, (unsigned)fake->node[id].cpu[k]);
	return 0;
}

long get_mempolicy(int *mode, unsigned long *nmask, unsigned long maxnode, void *addr,
		   unsigned flags)
{
	if (!fake || !(flags & MPOL_F_MEMS_ALLOWED))
		return REAL(get_mempolicy)(mode, nmask, maxnode, addr, flags);
	if (fake->policy_errno) {
		errno = fake->policy_errno;
		return -1;
	}
	memset(nmask, 0, (maxnode - 1 + LONG_BITS - 1) / LONG_BITS * sizeof *nmask);
	for (int i = 0; i < FAKE_NODES; i++)
		if (fake->node[i].mem)
			nmask[i / LONG_BITS] |= 1ul << (i % LONG_BITS);
	return 0;
}

static void fake_add(struct fake *f, int id, int cpu)
{
	f->node[id].exists = 1;
	f->node[id].cpu[f->node[id].n++] = cpu;
	if (id > f->max_node)
		f->max_node = id;
}

static void fake_init(struct fake *f, struct kvd_numa *n, unsigned max_nodes, int expect_rc)
{
	fake = f;
	int rc = kvd_numa_init(n, max_nodes);

	fake = NULL;
	assert_int_equal(rc, expect_rc);
	assert_int_equal(f->asked_missing, 0);
}

static void check_node(const struct kvd_numa_node *nd, int id, int mem, const int *cpu,
		       unsigned ncpu)
{
	assert_int_equal(nd->id, id);
	assert_int_equal(nd->mem, mem);
	assert_int_equal(nd->ncpus, ncpu);
	assert_memory_equal(nd->cpu, cpu, ncpu * sizeof *cpu);
}

static void check_pseudo(const struct kvd_numa *n, const char *why, const int *cpu,
			 unsigned ncpu)
{
	assert_int_equal(n->active, 0);
	assert_int_equal(n->nnodes, 1);
	assert_string_equal(n->why, why);
	check_node(&n->node[0], -1, -1, cpu, ncpu);
}

static void test_fake_topologies(void **state)
{
	static int cpu[CPU_SETSIZE];
	static struct fake f;
	unsigned ncpu = allowed(cpu, CPU_SETSIZE);
	int other = cpu[ncpu - 1] + 1;          /* a CPU we may not use */
	struct kvd_numa n;

	if (ncpu < 2) {
		printf("SKIP: fake topologies need two allowed CPUs\n");
		return;
	}

	/* Two nodes: the first CPU on node 0, the rest on node 1. */
	memset(&f, 0, sizeof f);
	f.node[0].mem = f.node[1].mem = 1;
	fake_add(&f, 0, cpu[0]);
	for (unsigned k = 1; k < ncpu; k++)
		fake_add(&f, 1, cpu[k]);
	fake_init(&f, &n, 0, 0);
	assert_int_equal(n.active, 1);
	assert_string_equal(n.why, "numa");
	assert_int_equal(n.nnodes, 2);
	check_node(&n.node[0], 0, 0, cpu, 1);
	check_node(&n.node[1], 1, 1, cpu + 1, ncpu - 1);
	check_covers(&n, cpu, ncpu);
	for (unsigned i = 0; i < n.nnodes; i++)
		check_pool(0, n.node[i].cpu, n.node[i].ncpus);
	for (unsigned h = 0; h < 4; h++)
		assert_int_equal(kvd_numa_pick(&n, NULL, h), h % 2);
	kvd_numa_fini(&n);
	fake_init(&f, &n, 2, 0);
	assert_int_equal(n.nnodes, 2);
	kvd_numa_fini(&n);
	fake_init(&f, &n, 1, 0);
	check_pseudo(&n, "max_nodes is 1", cpu, ncpu);
	kvd_numa_fini(&n);

	/* Sparse ids (no node 1, never asked about), node 2 memoryless,
	 * node 3 only CPUs we may not use (skipped). */
	memset(&f, 0, sizeof f);
	f.node[0].mem = f.node[3].mem = 1;
	fake_add(&f, 0, cpu[0]);
	for (unsigned k = 1; k < ncpu; k++)
		fake_add(&f, 2, cpu[k]);
	fake_add(&f, 3, other);
	fake_init(&f, &n, 0, 0);
	assert_int_equal(n.active, 1);
	assert_int_equal(n.nnodes, 2);
	check_node(&n.node[0], 0, 0, cpu, 1);
	check_node(&n.node[1], 2, -1, cpu + 1, ncpu - 1);
	kvd_numa_fini(&n);

	/* More nodes than max_nodes: the lowest ids are kept. */
	if (ncpu >= 3) {
		memset(&f, 0, sizeof f);
		for (unsigned k = 0; k < ncpu; k++)
			fake_add(&f, (int)(k % 3), cpu[k]);
		f.node[0].mem = f.node[1].mem = f.node[2].mem = 1;
		fake_init(&f, &n, 2, 0);
		assert_int_equal(n.active, 1);
		assert_int_equal(n.nnodes, 2);
		assert_int_equal(n.node[0].id, 0);
		assert_int_equal(n.node[1].id, 1);
		kvd_numa_fini(&n);
	} else {
		printf("SKIP: max_nodes cap needs three allowed CPUs\n");
	}

	/* Topologies that do not add up fall back to the pseudo-node. */
	memset(&f, 0, sizeof f);                /* an allowed CPU on no node */
	f.node[0].mem = f.node[1].mem = 1;
	fake_add(&f, 0, cpu[0]);
	fake_add(&f, 1, other);
	fake_init(&f, &n, 0, 0);
	check_pseudo(&n, "allowed CPUs outside every node", cpu, ncpu);
	kvd_numa_fini(&n);

	memset(&f, 0, sizeof f);                /* a CPU on two nodes */
	for (unsigned k = 0; k < ncpu; k++)
		fake_add(&f, 0, cpu[k]);
	fake_add(&f, 1, cpu[0]);
	fake_init(&f, &n, 0, 0);
	check_pseudo(&n, "a CPU on two nodes", cpu, ncpu);
	kvd_numa_fini(&n);

	memset(&f, 0, sizeof f);                /* two nodes, one with our CPUs */
	for (unsigned k = 0; k < ncpu; k++)
		fake_add(&f, 1, cpu[k]);
	fake_add(&f, 0, other);
	fake_init(&f, &n, 0, 0);
	check_pseudo(&n, "one node with allowed CPUs", cpu, ncpu);
	kvd_numa_fini(&n);

	/* libnuma or the kernel saying no. */
	memset(&f, 0, sizeof f);
	fake_add(&f, 0, cpu[0]);
	for (unsigned k = 1; k < ncpu; k++)
		fake_add(&f, 1, cpu[k]);
	f.cpus_fail = 1;
	fake_init(&f, &n, 0, 0);
	check_pseudo(&n, "a node's cpumap unreadable", cpu, ncpu);
	kvd_numa_fini(&n);
	f.cpus_fail = 0;
	f.policy_errno = EPERM;
	fake_init(&f, &n, 0, 0);
	check_pseudo(&n, "memory policy calls refused", cpu, ncpu);
	kvd_numa_fini(&n);
	f.policy_errno = 0;
	f.available = -1;
	fake_init(&f, &n, 0, 0);
	check_pseudo(&n, "libnuma unavailable", cpu, ncpu);
	kvd_numa_fini(&n);
	f.available = 0;
	f.max_node = 0;
	fake_init(&f, &n, 0, 0);
	check_pseudo(&n, "one node", cpu, ncpu);
	kvd_numa_fini(&n);
}

/* ---- pick -------------------------------------------------------------- */

static void test_pick_spreads(void **state)
{
	struct kvd_numa_node nodes[4] = { 0 };
	struct kvd_numa n = { .active = 1, .nnodes = 4, .node = nodes };
	unsigned count[4] = { 0 };
	uint64_t load[4] = { 0 };

	/* No loads: pure round-robin on the hint. */
	for (unsigned h = 0; h < 400; h++)
		count[kvd_numa_pick(&n, NULL, h)]++;
	for (int i = 0; i < 4; i++)
		assert_int_equal(count[i], 100);

	/* A burst of sequences created before any holds memory: equal (zero)
	 * loads, so ties rotate with the running count. */
	memset(count, 0, sizeof count);
	for (unsigned h = 0; h < 400; h++)
		count[kvd_numa_pick(&n, load, h)]++;
	for (int i = 0; i < 4; i++)
		assert_int_equal(count[i], 100);

	/* Loads growing with every pick, sizes varying: the spread stays
	 * within one sequence's size, and the same inputs give the same
	 * answers. */
	uint64_t again[4] = { 0 }, maxsz = 0, lo = UINT64_MAX, hi = 0;

	for (unsigned h = 0; h < 1000; h++) {
		uint64_t sz = 1 + (h * 2654435761u) % 100000;
		unsigned k = kvd_numa_pick(&n, load, h);

		assert_int_equal(k, kvd_numa_pick(&n, again, h));
		load[k] += sz;
		again[k] += sz;
		maxsz = sz > maxsz ? sz : maxsz;
	}
	for (int i = 0; i < 4; i++) {
		lo = load[i] < lo ? load[i] : lo;
		hi = load[i] > hi ? load[i] : hi;
	}
	assert_true(hi - lo <= maxsz);

	/* The least loaded wins; among equals, the first from the hint on. */
	uint64_t l2[4] = { 5, 1, 1, 7 };

	assert_int_equal(kvd_numa_pick(&n, l2, 0), 1);
	assert_int_equal(kvd_numa_pick(&n, l2, 2), 2);
	assert_int_equal(kvd_numa_pick(&n, l2, 3), 1);
	assert_int_equal(kvd_numa_pick(&n, l2, 6), 2);

	/* One node (the fallback): always 0. */
	n.nnodes = 1;
	assert_int_equal(kvd_numa_pick(&n, NULL, 12345), 0);
	assert_int_equal(kvd_numa_pick(&n, l2, 3), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_init_this_machine),
		cmocka_unit_test(test_pool_on_node),
		cmocka_unit_test(test_pool_cpus_errors),
		cmocka_unit_test(test_pool_create_pins),
		cmocka_unit_test(test_narrow_affinity),
		cmocka_unit_test(test_mem_on_node),
		cmocka_unit_test(test_pick_spreads),
		cmocka_unit_test(test_fake_topologies),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
