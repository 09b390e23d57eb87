/* Host emulation of the CUDA runtime and cuBLAS for libkvclient's CUDA
 * backend and its tests (docs/GPU.md, "Host emulation").  One host thread;
 * EMU_DEVICES=N (default 1, at most 8) devices sharing the host's memory.
 *
 * Devices.  Streams, events, pools, cuBLAS handles and allocations belong
 * to the device current when they were made.  Queuing work on a stream of
 * another device than the current one, recording an event of one device on
 * another's stream, a cuBLAS call with a handle of another device, and a
 * kernel whose arguments point into another device's memory are errors (a
 * real device fails or faults): so a backend that does not make its device
 * current at every entry point is caught with EMU_DEVICES=2.
 *
 * Faults.  emu_fail_next(api, kind) makes the next call of `api`
 * (cudaMemcpyAsync, cudaMemcpy2DAsync, cudaEventRecord,
 * cudaEventSynchronize; for copies only of cudaMemcpyKind `kind` unless it
 * is -1) fail with cudaErrorInvalidValue without doing anything, so tests
 * can drive the backend's error paths; emu_failures() counts those fired.
 *
 * Memory.  Device allocations are host heap blocks (so ASan sees overruns
 * and uses after free inside kernels) filled with 0xff bytes (NaN as float
 * and bf16), kept in a table.  Every copy and memset checks its direction
 * and its ranges against the table: the device side must lie inside one live
 * allocation, the host side must not touch one.  Freeing an unknown pointer
 * is an error.  Errors of this kind abort with "emu: ERROR: ...".
 *
 * Streams run lazily.  Kernels, copies, memsets, GEMMs, event records and
 * frees are queued on their stream and run only when something makes the
 * host wait for them (stream or event synchronize, event query, a blocking
 * cudaMemcpy, cudaFree, destroying a stream), a stream waiting on an event
 * first running what the event stands for.  So a host read of memory a copy
 * has not been waited for sees the old (or poisoned) bytes.  As in CUDA,
 * an asynchronous copy from pageable (not registered) host memory takes its
 * bytes when it is called, and one into pageable memory returns when done;
 * copies from and to registered memory (kvd's arena) are truly lazy.
 *
 * Ordering checks.  Every queued operation carries a vector clock (what it
 * is ordered after: its stream, the events its stream waited on, what the
 * host had waited for when it was queued).  Per allocation the emulator
 * keeps, per stream, the last operation that used it and the last that wrote
 * it.  Copies and memsets know what they read and write; a kernel's or
 * GEMM's uses are the allocations its by-value arguments point into (the
 * bytes of the launch's captured arguments are scanned for pointers).
 * Flagged: a cudaFreeAsync not ordered after every use on other streams; a
 * copy/memset/kernel/GEMM not ordered after a copy or memset on another
 * stream that wrote the same allocation (or a copy/memset writing what
 * another stream used); a use of stream-ordered memory not ordered after its
 * cudaMallocFromPoolAsync.  Not flagged: two kernels on different streams
 * racing (the emulator does not know what a kernel writes), races inside a
 * kernel between blocks, and a pointer a kernel computes rather than gets.
 *
 * Kernels.  Each block runs its threads as fibers (a small x86-64 context
 * switch, annotated for ASan) in the order EMU_ORDER says at every
 * rendezvous; see emu_kernel.h.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cublas_v2.h"
#include "cuda_runtime_api.h"
#include "emu_kernel.h"

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif

#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the emulator's fiber switch is written for x86-64"
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace {

/* ---- errors ------------------------------------------------------------------ */

const char *order_name(int o)
{
	return o == EMU_ORDER_FWD ? "fwd" : o == EMU_ORDER_REV ? "rev" : "rand";
}

int g_order = EMU_ORDER_FWD;
int g_ndev = 1, g_curdev;                  /* EMU_DEVICES; the current device */
const char *g_fail_api;                 /* emu_fail_next's armed fault */
int g_fail_kind;
unsigned g_failures;
unsigned long long g_seed = 1;
bool g_env_read;
const char *g_kernel_name;              /* the kernel running, for messages */

void read_env()
{
	if (g_env_read)
		return;
	g_env_read = true;
	const char *o = getenv("EMU_ORDER"), *s = getenv("EMU_SEED");

	if (o && !strcmp(o, "rev"))
		g_order = EMU_ORDER_REV;
	else if (o && !strcmp(o, "rand"))
		g_order = EMU_ORDER_RAND;
	else if (o && *o && strcmp(o, "fwd")) {
		fprintf(stderr, "emu: EMU_ORDER=%s: want fwd, rev or rand\n", o);
		exit(2);
	}
	if (s && *s)
		g_seed = strtoull(s, NULL, 0);
	const char *nd = getenv("EMU_DEVICES");

	if (nd && *nd) {
		g_ndev = atoi(nd);
		if (g_ndev < 1 || g_ndev > 8) {
			fprintf(stderr, "emu: EMU_DEVICES=%s: want 1 to 8\n", nd);
			exit(2);
		}
	}
}

/* True when the armed fault matches this call: it fires once. */
bool inject(const char *api, int kind)
{
	if (!g_fail_api || strcmp(g_fail_api, api) || (g_fail_kind >= 0 && kind != g_fail_kind))
		return false;
	g_fail_api = nullptr;
	g_failures++;
	fprintf(stderr, "emu: injected failure of %s\n", api);
	return true;
}

[[noreturn]] __attribute__((format(printf, 1, 2))) void fatal(const char *fmt, ...)
{
	va_list ap;

	fflush(stdout);
	fprintf(stderr, "emu: ERROR: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, " [EMU_ORDER=%s EMU_SEED=%llu]\n", order_name(g_order), g_seed);
	fflush(stderr);
	abort();
}

__attribute__((format(printf, 1, 2))) void note(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "emu: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

cudaError_t g_last = cudaSuccess;

cudaError_t fail(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
cudaError_t fail(cudaError_t e, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "emu: ");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return e;
}

uint64_t rng_state = 1;
uint64_t rng_next()
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* ---- vector clocks ---------------------------------------------------------- */

typedef std::vector<uint64_t> Clock;

void merge(Clock &a, const Clock &b)
{
	if (a.size() < b.size())
		a.resize(b.size(), 0);
	for (size_t i = 0; i < b.size(); i++)
		a[i] = std::max(a[i], b[i]);
}

uint64_t at(const Clock &c, int i)
{
	return (size_t)i < c.size() ? c[i] : 0;
}

/* Globals are never destroyed (LeakSanitizer runs after static destructors
 * and would see what they hold as leaked). */
template <class T> T &forever()
{
	return *new T();
}

Clock &g_host = forever<Clock>();       /* what the host has waited for */

} // namespace

/* ---- streams, events ---------------------------------------------------------- */

struct Op {
	enum Kind { RUN, WAIT, EVREC } kind;
	uint64_t seq;
	const char *what;
	std::function<void()> run;      /* RUN */
	struct CUstream_st *ws;         /* WAIT: run ws up to wseq first */
	uint64_t wseq;
	struct CUevent_st *ev;          /* EVREC */
	uint64_t gen;
};

struct CUstream_st {
	int id;
	int dev;                        /* -1: the legacy stream, every device's */
	bool blocking;                  /* syncs with the legacy stream */
	bool live;
	std::deque<Op> q;
	uint64_t enq = 0, done = 0;
	Clock clock;                    /* of the last op queued */
};

struct CUevent_st {
	bool timing, live;
	int dev;
	struct CUstream_st *s = nullptr; /* last record */
	uint64_t seq = 0, gen = 0, done_gen = 0;
	Clock clock;
	double t_ms = 0;
};

struct CUmemPoolHandle_st {
	int live;
	int dev;
};

struct cublasContext {
	cudaStream_t st;
	int live;
	int dev;
};

namespace {

std::vector<CUstream_st *> &g_streams = forever<std::vector<CUstream_st *>>(); /* by id; 0: legacy */
std::vector<CUevent_st *> &g_events = forever<std::vector<CUevent_st *>>();

CUstream_st *new_stream(bool blocking)
{
	CUstream_st *s = new CUstream_st;

	s->id = (int)g_streams.size();
	s->dev = g_streams.empty() ? -1 : g_curdev;
	s->blocking = blocking;
	s->live = true;
	g_streams.push_back(s);
	return s;
}

CUstream_st *legacy()
{
	if (g_streams.empty())
		new_stream(true);
	return g_streams[0];
}

bool stream_ok(cudaStream_t s)
{
	if (s == NULL || s == cudaStreamLegacy || s == cudaStreamPerThread)
		return true;
	for (CUstream_st *x : g_streams)
		if (x == s)
			return x->live;
	return false;
}

CUstream_st *S(cudaStream_t s, const char *fn)
{
	read_env();
	if (s == NULL || s == cudaStreamLegacy || s == cudaStreamPerThread)
		return legacy();
	if (!stream_ok(s))
		fatal("%s: stream %p is not a live stream", fn, (void *)s);
	return s;
}

double now_ms()
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

void run_until(CUstream_st *s, uint64_t seq);

void exec(Op &op)
{
	switch (op.kind) {
	case Op::RUN:
		op.run();
		break;
	case Op::WAIT:
		run_until(op.ws, op.wseq);
		break;
	case Op::EVREC:
		if (op.gen == op.ev->gen) {
			op.ev->t_ms = now_ms();
			op.ev->done_gen = op.gen;
		}
		break;
	}
}

void run_until(CUstream_st *s, uint64_t seq)
{
	while (s->done < seq && !s->q.empty()) {
		Op op = std::move(s->q.front());

		s->q.pop_front();
		exec(op);
		s->done = op.seq;
	}
}

void run_all()
{
	for (size_t i = 0; i < g_streams.size(); i++)
		run_until(g_streams[i], g_streams[i]->enq);
	for (CUstream_st *s : g_streams)
		merge(g_host, s->clock);
}

/* Puts op on s; returns its clock (what it is ordered after, itself included). */
const Clock &enqueue(CUstream_st *s, Op op)
{
	if (s->dev >= 0 && s->dev != g_curdev)
		fatal("%s on stream %d of device %d while device %d is current (cudaSetDevice "
		      "missing?)",
		      op.what, s->id, s->dev, g_curdev);
	/* the legacy stream and blocking streams wait for each other */
	if (s->id == 0) {
		for (CUstream_st *b : g_streams)
			if (b != s && b->live && b->blocking && b->enq) {
				Op w{};
				w.kind = Op::WAIT;
				w.ws = b;
				w.wseq = b->enq;
				w.what = "implicit sync with the legacy stream";
				merge(s->clock, b->clock);
				w.seq = ++s->enq;
				s->q.push_back(std::move(w));
			}
	} else if (s->blocking && legacy()->enq) {
		Op w{};
		w.kind = Op::WAIT;
		w.ws = legacy();
		w.wseq = legacy()->enq;
		w.what = "implicit sync with the legacy stream";
		merge(s->clock, legacy()->clock);
		w.seq = ++s->enq;
		s->q.push_back(std::move(w));
	}
	merge(s->clock, g_host);
	op.seq = ++s->enq;
	if (s->clock.size() <= (size_t)s->id)
		s->clock.resize(s->id + 1, 0);
	s->clock[s->id] = op.seq;
	s->q.push_back(std::move(op));
	return s->clock;
}

/* The host waits for s up to seq. */
void host_wait(CUstream_st *s, uint64_t seq, const Clock *c)
{
	run_until(s, seq);
	if (c)
		merge(g_host, *c);
}

/* ---- device memory -------------------------------------------------------------- */

struct Use {
	uint64_t use = 0, write = 0;
	const char *use_what = "", *write_what = "";
};

struct Alloc {
	uintptr_t base;
	size_t size;
	int dev;
	bool pool;
	int astream;                    /* stream-ordered allocation: (astream, aseq) */
	uint64_t aseq;
	std::map<int, Use> uses;        /* per stream */
};

std::map<uintptr_t, Alloc> &g_dev = forever<std::map<uintptr_t, Alloc>>(); /* live, by base */
std::map<uintptr_t, size_t> &g_freed = forever<std::map<uintptr_t, size_t>>(); /* freed, for messages */
std::map<uintptr_t, size_t> &g_reg = forever<std::map<uintptr_t, size_t>>(); /* registered host ranges */

Alloc *find_dev(const void *p)
{
	uintptr_t a = (uintptr_t)p;
	auto it = g_dev.upper_bound(a);

	if (it == g_dev.begin())
		return nullptr;
	--it;
	if (a >= it->second.base && a < it->second.base + std::max<size_t>(it->second.size, 1))
		return &it->second;
	return nullptr;
}

/* The first live allocation overlapping [p, p+n). */
Alloc *overlap_dev(const void *p, size_t n)
{
	uintptr_t a = (uintptr_t)p, e = a + n;
	Alloc *x = find_dev(p);

	if (x)
		return x;
	auto it = g_dev.upper_bound(a);

	if (it != g_dev.end() && it->second.base < e)
		return &it->second;
	return nullptr;
}

std::string freed_hint(const void *p)
{
	uintptr_t a = (uintptr_t)p;
	auto it = g_freed.upper_bound(a);
	char b[160];

	if (it == g_freed.begin())
		return "";
	--it;
	if (a >= it->first && a < it->first + std::max<size_t>(it->second, 1)) {
		snprintf(b, sizeof b, " (it was inside the allocation %p of %zu bytes, freed)",
			 (void *)it->first, it->second);
		return b;
	}
	return "";
}

Alloc *dev_range(const char *fn, const char *what, const void *p, size_t n)
{
	Alloc *a = find_dev(p);

	if (!a)
		fatal("%s: %s %p is not device memory (no live cudaMalloc'ed allocation holds "
		      "it)%s",
		      fn, what, p, freed_hint(p).c_str());
	if ((uintptr_t)p + n > a->base + a->size)
		fatal("%s: %s [%p, +%zu) overruns its allocation [%p, +%zu) by %zu bytes", fn, what,
		      p, n, (void *)a->base, a->size, (size_t)((uintptr_t)p + n - a->base - a->size));
	return a;
}

void host_range(const char *fn, const char *what, const void *p, size_t n)
{
	Alloc *a = overlap_dev(p, n);

	if (a)
		fatal("%s: %s [%p, +%zu) is device memory (allocation [%p, +%zu)), not host "
		      "memory: wrong cudaMemcpyKind?",
		      fn, what, p, n, (void *)a->base, a->size);
	if (!p && n)
		fatal("%s: %s is NULL", fn, what);
}


/* Checks a use of a by an op queued on s with clock c (write: it writes a,
 * known_dir: the op says whether it writes, i.e. it is a copy or memset). */
void check_use(Alloc *a, CUstream_st *s, const Clock &c, bool write, bool known_dir,
	       const char *what)
{
	if (a->pool && a->astream != s->id && at(c, a->astream) < a->aseq)
		fatal("%s on stream %d uses [%p, +%zu), allocated by cudaMallocFromPoolAsync on "
		      "stream %d, without being ordered after that allocation",
		      what, s->id, (void *)a->base, a->size, a->astream);
	for (auto &u : a->uses) {
		if (u.first == s->id)
			continue;
		if (u.second.write > at(c, u.first))
			fatal("%s on stream %d uses [%p, +%zu), which %s on stream %d writes, with "
			      "nothing ordering the two (an event or a synchronisation is missing)",
			      what, s->id, (void *)a->base, a->size, u.second.write_what, u.first);
		if (write && known_dir && u.second.use > at(c, u.first))
			fatal("%s on stream %d writes [%p, +%zu), which %s on stream %d uses, with "
			      "nothing ordering the two (an event or a synchronisation is missing)",
			      what, s->id, (void *)a->base, a->size, u.second.use_what, u.first);
	}
}

void record_use(Alloc *a, CUstream_st *s, uint64_t seq, bool write, const char *what)
{
	Use &u = a->uses[s->id];

	u.use = seq;
	u.use_what = what;
	if (write) {
		u.write = seq;
		u.write_what = what;
	}
}

void *dev_alloc(size_t size, bool pool, CUstream_st *s)
{
	void *p = nullptr;

	if (posix_memalign(&p, 256, size ? size : 1))
		return nullptr;
	memset(p, 0xff, size ? size : 1);       /* poison: NaN as float and bf16 */
	for (auto it = g_freed.begin(); it != g_freed.end();)
		if (it->first < (uintptr_t)p + size && (uintptr_t)p < it->first + it->second)
			it = g_freed.erase(it);
		else
			++it;
	Alloc a{};
	a.base = (uintptr_t)p;
	a.size = size;
	a.dev = g_curdev;
	a.pool = pool;
	a.astream = s ? s->id : 0;
	a.aseq = s ? s->enq : 0;
	g_dev[a.base] = a;
	return p;
}

void dev_release(uintptr_t base, size_t size)
{
	g_freed[base] = size;
	if (g_freed.size() > 4096)
		g_freed.erase(g_freed.begin());
	free((void *)base);
}

/* ---- fibers ------------------------------------------------------------------------- */

extern "C" void emu_ctx_switch(void **save_sp, void *to_sp);
extern "C" void emu_fiber_entry(void);

__asm__(".text\n"
	".globl emu_ctx_switch\n"
	".hidden emu_ctx_switch\n"
	".type emu_ctx_switch,@function\n"
	"emu_ctx_switch:\n"
	"\t.cfi_startproc\n"
	"\tpushq %rbp\n"
	"\tpushq %rbx\n"
	"\tpushq %r12\n"
	"\tpushq %r13\n"
	"\tpushq %r14\n"
	"\tpushq %r15\n"
	"\tsubq $8, %rsp\n"
	"\tstmxcsr (%rsp)\n"
	"\tfnstcw 4(%rsp)\n"
	"\tmovq %rsp, (%rdi)\n"
	"\tmovq %rsi, %rsp\n"
	"\tldmxcsr (%rsp)\n"
	"\tfldcw 4(%rsp)\n"
	"\taddq $8, %rsp\n"
	"\tpopq %r15\n"
	"\tpopq %r14\n"
	"\tpopq %r13\n"
	"\tpopq %r12\n"
	"\tpopq %rbx\n"
	"\tpopq %rbp\n"
	"\tret\n"
	"\t.cfi_endproc\n"
	".size emu_ctx_switch, .-emu_ctx_switch\n");

enum { F_READY, F_BAR, F_SHFL, F_DONE };

struct Fiber {
	void *sp;
	char *stack;                    /* usable stack, above a guard page */
	size_t stack_size;
	void *fake;                     /* ASan's fake stack while switched out */
	uint3 tid;
	unsigned lin;
	int state;
	const char *file;
	int line;
	int kind, arg, width;
	unsigned mask;
	uint64_t val, res;
};

const size_t STACK = 256 << 10;
std::vector<Fiber> &g_fib = forever<std::vector<Fiber>>();
void *g_sched_sp;
const void *g_sched_bottom;
size_t g_sched_size;
Fiber *g_cur;
const std::function<void()> *g_body;
unsigned char *g_smem;
size_t g_smem_size;
unsigned g_nthreads;

void fibers_ensure(unsigned n)
{
	while (g_fib.size() < n) {
		size_t page = 4096;
		char *m = (char *)mmap(nullptr, STACK + page, PROT_READ | PROT_WRITE,
				       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);

		if (m == MAP_FAILED)
			fatal("mmap of a fiber stack: %s", strerror(errno));
		mprotect(m, page, PROT_NONE);   /* guard: a stack overflow faults */
		Fiber f{};
		f.stack = m + page;
		f.stack_size = STACK;
		g_fib.push_back(f);
	}
}

void fiber_init(Fiber *f)
{
#ifdef EMU_ASAN
	/* A fiber that ran to its end returned from every frame but its
	 * entry's and the switch's, at the top of the stack: those are the
	 * redzones a previous fiber can have left there. */
	__asan_unpoison_memory_region(f->stack + f->stack_size - (16 << 10), 16 << 10);
#endif
	uint64_t *sp = (uint64_t *)(f->stack + f->stack_size);
	uint32_t csr[2];

	__asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
	__asm__ volatile("fnstcw %0" : "=m"(csr[1]));
	*--sp = 0;                                      /* the entry's return address */
	*--sp = (uint64_t)(uintptr_t)&emu_fiber_entry;  /* popped by ret */
	for (int i = 0; i < 6; i++)
		*--sp = 0;                              /* rbp rbx r12 r13 r14 r15 */
	--sp;
	memcpy(sp, csr, 8);                             /* mxcsr, x87 control word */
	f->sp = sp;
	f->fake = nullptr;
	f->state = F_READY;
}

void to_fiber(Fiber *f)
{
	g_cur = f;
	threadIdx = f->tid;
#ifdef EMU_ASAN
	void *fake = nullptr;

	__sanitizer_start_switch_fiber(&fake, f->stack, f->stack_size);
	emu_ctx_switch(&g_sched_sp, f->sp);
	__sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
	emu_ctx_switch(&g_sched_sp, f->sp);
#endif
	g_cur = nullptr;
}

/* On a fiber: back to the scheduler (for good when exiting). */
void to_sched(Fiber *f, bool exiting)
{
#ifdef EMU_ASAN
	__sanitizer_start_switch_fiber(exiting ? nullptr : &f->fake, g_sched_bottom, g_sched_size);
	emu_ctx_switch(&f->sp, g_sched_sp);
	__sanitizer_finish_switch_fiber(f->fake, nullptr, nullptr);
#else
	(void)exiting;
	emu_ctx_switch(&f->sp, g_sched_sp);
#endif
}

} // namespace

extern "C" void emu_fiber_entry(void)
{
	Fiber *f = g_cur;

#ifdef EMU_ASAN
	__sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
	(*g_body)();
	f->state = F_DONE;
	to_sched(f, true);
	fatal("a finished fiber was resumed");
}

namespace {

std::string lanes(const std::vector<unsigned> &v)
{
	std::string s;
	char b[32];

	for (size_t i = 0; i < v.size();) {
		size_t j = i;

		while (j + 1 < v.size() && v[j + 1] == v[j] + 1)
			j++;
		if (!s.empty())
			s += ",";
		if (j == i)
			snprintf(b, sizeof b, "%u", v[i]);
		else
			snprintf(b, sizeof b, "%u-%u", v[i], v[j]);
		s += b;
		i = j + 1;
		if (s.size() > 200) {
			s += ",...";
			break;
		}
	}
	return s;
}

bool registered(const void *p, size_t n)
{
	auto it = g_reg.upper_bound((uintptr_t)p);

	if (it == g_reg.begin())
		return false;
	--it;
	return (uintptr_t)p >= it->first && (uintptr_t)p + n <= it->first + it->second;
}

const char *base_name(const char *f)
{
	const char *s = strrchr(f, '/');

	return s ? s + 1 : f;
}

[[noreturn]] void block_fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void block_fatal(const char *fmt, ...)
{
	char b[1024];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(b, sizeof b, fmt, ap);
	va_end(ap);
	fatal("kernel %s, block (%u,%u,%u) of (%u,%u,%u), %u threads: %s", g_kernel_name,
	      blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, g_nthreads, b);
}

/* The scheduler's own bookkeeping is not worth ASan's checks (it is most of
 * the emulator's time); kernels and everything else keep them. */
#define EMU_HOT __attribute__((no_sanitize("address"), optimize("O2")))

/* Resolves what can be; false when nothing could (an error was reported). */
EMU_HOT bool resolve(Fiber **ready, unsigned &nready)
{
	Fiber *fib = g_fib.data();
	unsigned n = g_nthreads, nbar = 0, ndone = 0;
	bool progress = false;

	for (unsigned i = 0; i < n; i++) {
		nbar += fib[i].state == F_BAR;
		ndone += fib[i].state == F_DONE;
	}
	if (nbar && ndone) {
		std::vector<unsigned> d, b;

		for (unsigned i = 0; i < n; i++)
			if (fib[i].state == F_DONE)
				d.push_back(i);
			else if (fib[i].state == F_BAR)
				b.push_back(i);
		Fiber &w = fib[b[0]];

		block_fatal("threads %s exited while threads %s wait at __syncthreads (%s:%d): "
			    "every thread of the block must reach it",
			    lanes(d).c_str(), lanes(b).c_str(), base_name(w.file), w.line);
	}
	/* warp shuffles, one group (mask) at a time */
	for (unsigned w0 = 0; w0 < n; w0 += 32) {
		unsigned wn = std::min(32u, n - w0);

		for (unsigned l = 0; l < wn; l++) {
			Fiber &f = fib[w0 + l];

			if (f.state != F_SHFL)
				continue;
			unsigned m = f.mask;

			if (!(m >> l & 1))
				block_fatal("lane %u of warp %u (thread %u) calls __shfl*_sync (%s:%d) "
					    "with mask 0x%08x that leaves it out",
					    l, w0 / 32, w0 + l, base_name(f.file), f.line, m);
			for (unsigned k = 0; k < 32; k++) {
				if (!(m >> k & 1))
					continue;
				if (k >= wn)
					block_fatal("__shfl*_sync (%s:%d) mask 0x%08x names lane %u of "
						    "warp %u, which the block does not have",
						    base_name(f.file), f.line, m, k, w0 / 32);
				Fiber &g = fib[w0 + k];

				if (g.state == F_DONE)
					block_fatal("lane %u of warp %u (thread %u) exited while lane %u "
						    "waits in __shfl*_sync (%s:%d) with mask 0x%08x: a "
						    "lane in the mask is missing",
						    k, w0 / 32, w0 + k, l, base_name(f.file), f.line, m);
				if (g.state == F_BAR)
					block_fatal("lane %u of warp %u waits at __syncthreads (%s:%d) "
						    "while lane %u waits in __shfl*_sync (%s:%d) with "
						    "mask 0x%08x: divergent warp, a lane in the mask is "
						    "missing",
						    k, w0 / 32, base_name(g.file), g.line, l,
						    base_name(f.file), f.line, m);
				if (g.mask != m || g.kind != f.kind || g.line != f.line ||
				    g.file != f.file || g.width != f.width)
					block_fatal("lanes %u and %u of warp %u meet in different "
						    "shuffles: %s:%d mask 0x%08x vs %s:%d mask 0x%08x",
						    l, k, w0 / 32, base_name(f.file), f.line, m,
						    base_name(g.file), g.line, g.mask);
			}
			/* complete: exchange */
			for (unsigned k = 0; k < 32; k++) {
				if (!(m >> k & 1))
					continue;
				Fiber &g = fib[w0 + k];
				unsigned wd = (unsigned)g.width, seg = k & ~(wd - 1), src;

				if (g.kind == EMU_SHFL_IDX)
					src = seg + ((unsigned)g.arg & (wd - 1));
				else
					src = k ^ (unsigned)g.arg;
				if (src >= seg + wd || src < seg)
					src = k;        /* outside the segment: own value */
				if (!(m >> src & 1))
					block_fatal("lane %u of warp %u reads lane %u in __shfl*_sync "
						    "(%s:%d), which mask 0x%08x leaves out (undefined "
						    "value)",
						    k, w0 / 32, src, base_name(g.file), g.line, m);
				g.res = fib[w0 + src].val;
			}
			for (unsigned k = 0; k < 32; k++)
				if (m >> k & 1) {
					fib[w0 + k].state = F_READY;
					ready[nready++] = &fib[w0 + k];
				}
			progress = true;
		}
	}
	if (progress)
		return true;
	if (nbar) {
		for (unsigned i = 0; i < n; i++)
			if (fib[i].state != F_BAR)
				block_fatal("threads wait at __syncthreads (%s:%d) while thread %u does "
					    "not arrive (state %d)",
					    base_name(fib[0].file), fib[0].line, i, fib[i].state);
		Fiber &a = fib[0];

		for (unsigned i = 1; i < n; i++)
			if (fib[i].line != a.line || fib[i].file != a.file)
				block_fatal("threads meet at different __syncthreads: thread 0 at "
					    "%s:%d, thread %u at %s:%d",
					    base_name(a.file), a.line, i, base_name(fib[i].file),
					    fib[i].line);
		for (unsigned i = 0; i < n; i++) {
			fib[i].state = F_READY;
			ready[nready++] = &fib[i];
		}
		return true;
	}
	return false;
}

/* resolve() and run_block() list ready fibers by increasing thread index,
 * nearly always */
EMU_HOT void order(Fiber **v, unsigned n)
{
	auto lt = [](Fiber *a, Fiber *b) { return a->lin < b->lin; };

	if (g_order != EMU_ORDER_RAND && !std::is_sorted(v, v + n, lt))
		std::sort(v, v + n, lt);
	if (g_order == EMU_ORDER_REV)
		std::reverse(v, v + n);
	else if (g_order == EMU_ORDER_RAND)
		for (unsigned i = n; i > 1; i--)
			std::swap(v[i - 1], v[rng_next() % i]);
}

EMU_HOT void run_block(dim3 block)
{
	unsigned n = block.x * block.y * block.z, nready = 0;
	static std::vector<Fiber *> &readyv = forever<std::vector<Fiber *>>();

	g_nthreads = n;
	fibers_ensure(n);
	readyv.resize(n);
	Fiber *fib = g_fib.data(), **ready = readyv.data();

	if (posix_memalign((void **)&g_smem, 16, g_smem_size ? g_smem_size : 1))
		fatal("out of memory for shared memory");
	memset(g_smem, 0xff, g_smem_size ? g_smem_size : 1);
	for (unsigned i = 0; i < n; i++) {
		Fiber &f = fib[i];

		fiber_init(&f);
		f.lin = i;
		f.tid = uint3{ i % block.x, i / block.x % block.y, i / (block.x * block.y) };
		ready[nready++] = &f;
	}
	for (;;) {
		order(ready, nready);
		for (unsigned i = 0; i < nready; i++)
			to_fiber(ready[i]);
		nready = 0;
		unsigned done = 0;

		for (unsigned i = 0; i < n; i++)
			done += fib[i].state == F_DONE;
		if (done == n)
			break;
		if (!resolve(ready, nready))
			block_fatal("no thread can go on (internal error)");
	}
	free(g_smem);
	g_smem = nullptr;
}

struct Kernel {
	dim3 grid, block;
	size_t smem;
	const char *name;
	std::function<void()> body;
};

void run_kernel(const Kernel &k)
{
	size_t nb = (size_t)k.grid.x * k.grid.y * k.grid.z;
	std::vector<size_t> ord(nb);

	for (size_t i = 0; i < nb; i++)
		ord[i] = i;
	if (g_order == EMU_ORDER_REV)
		std::reverse(ord.begin(), ord.end());
	else if (g_order == EMU_ORDER_RAND)
		for (size_t i = nb; i > 1; i--)
			std::swap(ord[i - 1], ord[rng_next() % i]);
	g_kernel_name = k.name;
	g_body = &k.body;
	g_smem_size = k.smem;
	gridDim = k.grid;
	blockDim = k.block;
	for (size_t b : ord) {
		blockIdx = uint3{ (unsigned)(b % k.grid.x), (unsigned)(b / k.grid.x % k.grid.y),
				  (unsigned)(b / ((size_t)k.grid.x * k.grid.y)) };
		run_block(k.block);
	}
	g_kernel_name = nullptr;
	g_body = nullptr;
}

std::map<const void *, int> &g_smem_max = forever<std::map<const void *, int>>(); /* per kernel */
const int SMEM_DEFAULT = 48 << 10, SMEM_OPTIN = 227 << 10;

Fiber *cur(const char *what)
{
	if (!g_cur)
		fatal("%s called outside a kernel", what);
	return g_cur;
}

} // namespace

/* ---- device-side entry points ------------------------------------------------------------ */

void emu_syncthreads(const char *file, int line)
{
	Fiber *f = cur("__syncthreads");

	f->state = F_BAR;
	f->file = file;
	f->line = line;
	to_sched(f, false);
}

uint64_t emu_shfl(const char *file, int line, int kind, unsigned mask, uint64_t bits, int arg,
		  int width)
{
	Fiber *f = cur("__shfl_sync");

	if (width <= 0 || width > 32 || (width & (width - 1)))
		block_fatal("__shfl*_sync (%s:%d) with width %d", base_name(file), line, width);
	f->state = F_SHFL;
	f->file = file;
	f->line = line;
	f->kind = kind;
	f->mask = mask;
	f->val = bits;
	f->arg = arg;
	f->width = width;
	to_sched(f, false);
	return f->res;
}

void *emu_dyn_smem(void)
{
	cur("dynamic shared memory");
	return g_smem_size ? g_smem : nullptr;
}

extern "C" void emu_set_order(int o, unsigned long long seed)
{
	read_env();
	g_order = o;
	g_seed = seed;
	rng_state = seed;
}

extern "C" int emu_get_order(void)
{
	read_env();
	return g_order;
}

void emu_launch_fn(dim3 grid, dim3 block, size_t smem, cudaStream_t st, const char *name,
		   const void *kernel, std::function<void()> fn, const void *args, size_t argsz)
{
	static bool seeded;
	CUstream_st *s;
	uint64_t nt = (uint64_t)block.x * block.y * block.z;
	auto lim = g_smem_max.find(kernel);
	int smax = lim == g_smem_max.end() ? SMEM_DEFAULT : lim->second;

	read_env();
	if (!seeded) {
		seeded = true;
		rng_state = g_seed;
	}
	if (!stream_ok(st)) {
		g_last = fail(cudaErrorInvalidResourceHandle, "launch of %s: invalid stream", name);
		return;
	}
	s = S(st, name);
	if (!block.x || !block.y || !block.z || nt > 1024 || block.x > 1024 || block.y > 1024 ||
	    block.z > 64 || !grid.x || !grid.y || !grid.z || grid.x > 0x7fffffffu ||
	    grid.y > 65535 || grid.z > 65535) {
		g_last = fail(cudaErrorInvalidConfiguration,
			      "launch of %s: grid (%u,%u,%u) x block (%u,%u,%u) is not a valid "
			      "configuration (block <= 1024 threads, (1024,1024,64); grid <= "
			      "(2^31-1,65535,65535))",
			      name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
		return;
	}
	if (smem > (size_t)smax) {
		g_last = fail(cudaErrorInvalidValue,
			      "launch of %s: %zu bytes of dynamic shared memory, more than the %d "
			      "this kernel may use (48 KiB unless cudaFuncSetAttribute("
			      "cudaFuncAttributeMaxDynamicSharedMemorySize) raised it for it)",
			      name, smem, smax);
		return;
	}
	Kernel k{ grid, block, smem, name, std::move(fn) };
	Op op{};

	op.kind = Op::RUN;
	op.what = name;
	op.run = [k]() { run_kernel(k); };
	enqueue(s, std::move(op));
	/* the allocations the arguments point into: the kernel's uses (read or
	 * written: the emulator cannot tell) */
	std::vector<Alloc *> used;
	const unsigned char *ab = (const unsigned char *)args;

	for (size_t off = 0; off + 8 <= argsz; off += 8) {
		uintptr_t p;

		memcpy(&p, ab + off, 8);
		Alloc *a = p > 4096 ? find_dev((const void *)p) : nullptr;

		if (a && std::find(used.begin(), used.end(), a) == used.end()) {
			if (a->dev != g_curdev)
				fatal("kernel %s on device %d gets a pointer into [%p, +%zu), memory of "
				      "device %d",
				      name, g_curdev, (void *)a->base, a->size, a->dev);
			check_use(a, s, s->clock, false, false, name);
			record_use(a, s, s->enq, false, name);
			used.push_back(a);
		}
	}
}

/* ---- the runtime API ---------------------------------------------------------------------- */

extern "C" {

cudaError_t cudaGetDeviceCount(int *count)
{
	read_env();
	*count = g_ndev;
	return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
	read_env();
	if (device < 0 || device >= g_ndev)
		return fail(cudaErrorInvalidDevice, "cudaSetDevice(%d)", device);
	g_curdev = device;
	return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
	*device = g_curdev;
	return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
	read_env();
	if (device < 0 || device >= g_ndev)
		return fail(cudaErrorInvalidDevice, "cudaDeviceGetAttribute: device %d", device);
	switch (attr) {     /* an H100 SXM's */
	case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
	case cudaDevAttrMaxSharedMemoryPerBlock: *value = SMEM_DEFAULT; break;
	case cudaDevAttrWarpSize: *value = 32; break;
	case cudaDevAttrMultiProcessorCount: *value = 132; break;
	case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
	case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
	case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = SMEM_OPTIN; break;
	default: return fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d", attr);
	}
	return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
	cudaError_t e = g_last;

	g_last = cudaSuccess;
	return e;
}

const char *cudaGetErrorString(cudaError_t e)
{
	switch (e) {
	case cudaSuccess: return "no error";
	case cudaErrorInvalidValue: return "invalid argument";
	case cudaErrorMemoryAllocation: return "out of memory";
	case cudaErrorInitializationError: return "initialization error";
	case cudaErrorInvalidConfiguration: return "invalid configuration argument";
	case cudaErrorInvalidPitchValue: return "invalid pitch argument";
	case cudaErrorInvalidDevicePointer: return "invalid device pointer";
	case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
	case cudaErrorNoDevice: return "no CUDA-capable device is detected";
	case cudaErrorInvalidDevice: return "invalid device ordinal";
	case cudaErrorInvalidResourceHandle: return "invalid resource handle";
	case cudaErrorNotReady: return "device not ready";
	case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
	case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
	case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
	case cudaErrorNotSupported: return "operation not supported";
	}
	return "unrecognized error code";
}

cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value)
{
	if (!func)
		return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: NULL function");
	if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
		return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d not emulated",
			    attr);
	if (value < 0 || value > SMEM_OPTIN)
		return fail(cudaErrorInvalidValue,
			    "cudaFuncSetAttribute: MaxDynamicSharedMemorySize %d > %d (227 KiB)",
			    value, SMEM_OPTIN);
	g_smem_max[func] = value;
	return cudaSuccess;
}

/* streams and events */

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags)
{
	read_env();
	legacy();
	if (flags & ~1u)
		return fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: flags %#x", flags);
	*stream = new_stream(!(flags & cudaStreamNonBlocking));
	return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
	if (!stream || stream == cudaStreamLegacy || stream == cudaStreamPerThread ||
	    !stream_ok(stream))
		return fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: %p",
			    (void *)stream);
	/* its work still completes (now: running it early is a valid schedule) */
	run_until(stream, stream->enq);
	stream->live = false;
	return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream)
{
	CUstream_st *s = S(stream, "cudaStreamSynchronize");

	host_wait(s, s->enq, &s->clock);
	return cudaSuccess;
}

static bool event_ok(cudaEvent_t e)
{
	return e && e->live;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
{
	CUstream_st *s = S(stream, "cudaStreamWaitEvent");

	if (!event_ok(event))
		fatal("cudaStreamWaitEvent: %p is not a live event", (void *)event);
	if (!event->s)
		return cudaSuccess;     /* never recorded: nothing to wait for */
	Op op{};

	op.kind = Op::WAIT;
	op.what = "cudaStreamWaitEvent";
	op.ws = event->s;
	op.wseq = event->seq;
	merge(s->clock, event->clock);
	enqueue(s, std::move(op));
	return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
	CUevent_st *e = new CUevent_st;

	e->timing = !(flags & cudaEventDisableTiming);
	e->live = true;
	e->dev = g_curdev;
	g_events.push_back(e);  /* kept: queued records may refer to it after destroy */
	*event = e;
	return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event)
{
	return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event)
{
	if (!event_ok(event))
		fatal("cudaEventDestroy: %p is not a live event", (void *)event);
	event->live = false;    /* kept: queued records may still refer to it */
	return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
	if (inject("cudaEventRecord", -1))
		return cudaErrorInvalidValue;
	CUstream_st *s = S(stream, "cudaEventRecord");

	if (!event_ok(event))
		fatal("cudaEventRecord: %p is not a live event", (void *)event);
	if (event->dev != (s->dev >= 0 ? s->dev : g_curdev))
		fatal("cudaEventRecord: event of device %d recorded on a stream of device %d",
		      event->dev, s->dev >= 0 ? s->dev : g_curdev);
	Op op{};

	op.kind = Op::EVREC;
	op.what = "cudaEventRecord";
	op.ev = event;
	op.gen = ++event->gen;
	event->clock = enqueue(s, std::move(op));
	event->s = s;
	event->seq = s->enq;
	return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
	if (inject("cudaEventSynchronize", -1))
		return cudaErrorInvalidValue;
	if (!event_ok(event))
		fatal("cudaEventSynchronize: %p is not a live event", (void *)event);
	if (event->s)
		host_wait(event->s, event->seq, &event->clock);
	return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event)
{
	/* a query that says "done" is a wait that returned */
	return cudaEventSynchronize(event);
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
	if (!event_ok(a) || !event_ok(b))
		fatal("cudaEventElapsedTime: not a live event");
	if (!a->timing || !b->timing || !a->s || !b->s)
		return cudaErrorInvalidResourceHandle;
	if (a->done_gen != a->gen || b->done_gen != b->gen)
		return cudaErrorNotReady;
	*ms = (float)(b->t_ms - a->t_ms);
	return cudaSuccess;
}

/* memory */

cudaError_t cudaMalloc(void **p, size_t size)
{
	read_env();
	*p = dev_alloc(size, false, nullptr);
	return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void *p)
{
	if (!p)
		return cudaSuccess;
	Alloc *a = find_dev(p);

	if (!a || a->base != (uintptr_t)p)
		fatal("cudaFree(%p): not the start of a live device allocation%s", p,
		      a ? " (inside one)" : freed_hint(p).c_str());
	/* cudaFree waits for the device: everything queued runs first */
	run_all();
	uintptr_t base = a->base;
	size_t size = a->size;

	g_dev.erase(base);
	dev_release(base, size);
	return cudaSuccess;
}

cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const struct cudaMemPoolProps *props)
{
	if (!props || props->allocType != cudaMemAllocationTypePinned ||
	    props->location.type != cudaMemLocationTypeDevice || props->location.id < 0 ||
	    props->location.id >= g_ndev)
		return fail(cudaErrorInvalidValue, "cudaMemPoolCreate: unsupported properties");
	*pool = new CUmemPoolHandle_st{ 1, props->location.id };
	return cudaSuccess;
}

cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool)
{
	if (!pool || !pool->live)
		fatal("cudaMemPoolDestroy: %p is not a live pool", (void *)pool);
	pool->live = 0;
	delete pool;
	return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, enum cudaMemPoolAttr attr, void *value)
{
	if (!pool || !pool->live || !value)
		return cudaErrorInvalidValue;
	return cudaSuccess;
}

cudaError_t cudaMallocFromPoolAsync(void **p, size_t size, cudaMemPool_t pool, cudaStream_t st)
{
	CUstream_st *s = S(st, "cudaMallocFromPoolAsync");

	if (!pool || !pool->live)
		fatal("cudaMallocFromPoolAsync: %p is not a live pool", (void *)pool);
	if (pool->dev != g_curdev)
		fatal("cudaMallocFromPoolAsync: a pool of device %d while device %d is current",
		      pool->dev, g_curdev);
	Op op{};

	op.kind = Op::RUN;
	op.what = "cudaMallocFromPoolAsync";
	op.run = []() {};
	enqueue(s, std::move(op));
	*p = dev_alloc(size, true, s);
	return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeAsync(void *p, cudaStream_t st)
{
	CUstream_st *s = S(st, "cudaFreeAsync");
	Alloc *a = find_dev(p);

	if (!p)
		return cudaSuccess;
	if (!a || a->base != (uintptr_t)p)
		fatal("cudaFreeAsync(%p): not the start of a live device allocation%s", p,
		      a ? " (inside one)" : freed_hint(p).c_str());
	uintptr_t base = a->base;
	size_t size = a->size;
	Op op{};

	op.kind = Op::RUN;
	op.what = "cudaFreeAsync";
	op.run = [base, size]() { dev_release(base, size); };
	const Clock &c = enqueue(s, std::move(op));

	for (auto &u : a->uses)
		if (u.first != s->id && u.second.use > at(c, u.first))
			fatal("cudaFreeAsync(%p) on stream %d is not ordered after its use by %s on "
			      "stream %d (an event or a synchronisation is missing)",
			      p, s->id, u.second.use_what, u.first);
	if (a->pool && a->astream != s->id && at(c, a->astream) < a->aseq)
		fatal("cudaFreeAsync(%p) on stream %d is not ordered after its allocation on stream "
		      "%d",
		      p, s->id, a->astream);
	g_dev.erase(base);
	g_freed[base] = size;   /* for messages now; the memory goes in stream order */
	return cudaSuccess;
}

cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
	uintptr_t a = (uintptr_t)ptr;

	if (!ptr || !size || flags != cudaHostRegisterDefault)
		return fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu, %#x)", ptr, size, flags);
	if (overlap_dev(ptr, size))
		fatal("cudaHostRegister(%p, %zu): that is device memory", ptr, size);
	auto it = g_reg.upper_bound(a);

	if ((it != g_reg.end() && it->first < a + size) ||
	    (it != g_reg.begin() && std::prev(it)->first + std::prev(it)->second > a))
		return cudaErrorHostMemoryAlreadyRegistered;
	g_reg[a] = size;
	return cudaSuccess;
}

cudaError_t cudaHostUnregister(void *ptr)
{
	auto it = g_reg.find((uintptr_t)ptr);

	if (it == g_reg.end())
		return fail(cudaErrorHostMemoryNotRegistered, "cudaHostUnregister(%p)", ptr);
	/* copies from or to it that are still queued must run while it is registered */
	run_all();
	g_reg.erase(it);
	return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *at_, const void *ptr)
{
	Alloc *a = find_dev(ptr);

	memset(at_, 0, sizeof *at_);
	if (a) {
		at_->type = cudaMemoryTypeDevice;
		at_->devicePointer = (void *)ptr;
		return cudaSuccess;
	}
	auto it = g_reg.upper_bound((uintptr_t)ptr);

	if (it != g_reg.begin() && (uintptr_t)ptr < std::prev(it)->first + std::prev(it)->second) {
		at_->type = cudaMemoryTypeHost;
		at_->hostPointer = at_->devicePointer = (void *)ptr;
		return cudaSuccess;
	}
	at_->type = cudaMemoryTypeUnregistered;
	at_->device = -2;
	return cudaSuccess;
}

} // extern "C"

namespace {

/* A copy of height rows of width bytes (pitches dp, sp) queued on s. */
cudaError_t copy2d(const char *fn, void *dst, size_t dp, const void *src, size_t sp, size_t width,
		   size_t height, enum cudaMemcpyKind kind, CUstream_st *s)
{
	if (s && inject(fn, kind))
		return cudaErrorInvalidValue;
	if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost &&
	    kind != cudaMemcpyDeviceToDevice)
		return fail(cudaErrorInvalidMemcpyDirection,
			    "%s: cudaMemcpyKind %d is not emulated (H2D, D2H, D2D only)", fn, kind);
	if (height > 1 && (width > dp || width > sp))
		return fail(cudaErrorInvalidPitchValue, "%s: width %zu > pitch (%zu, %zu)", fn, width,
			    dp, sp);
	if (!width || !height)
		return cudaSuccess;
	size_t dspan = (height - 1) * dp + width, sspan = (height - 1) * sp + width;
	bool dd = kind != cudaMemcpyDeviceToHost, sd = kind != cudaMemcpyHostToDevice;
	Alloc *da = nullptr, *sa = nullptr;

	if ((dd && !find_dev(dst) && !sd && find_dev(src)) ||
	    (sd && !find_dev(src) && !dd && find_dev(dst)))
		fatal("%s: kind %s, but the destination %p is %s memory and the source %p %s: "
		      "wrong cudaMemcpyKind",
		      fn, kind == cudaMemcpyHostToDevice ? "HostToDevice" : "DeviceToHost", dst,
		      find_dev(dst) ? "device" : "host", src, find_dev(src) ? "device" : "host");
	if (dd)
		da = dev_range(fn, "destination", dst, dspan);
	else
		host_range(fn, "destination", dst, dspan);
	if (sd)
		sa = dev_range(fn, "source", src, sspan);
	else
		host_range(fn, "source", src, sspan);
	Op op{};

	op.kind = Op::RUN;
	op.what = fn;
	if (kind == cudaMemcpyHostToDevice && !registered(src, sspan)) {
		/* from pageable memory: CUDA stages the bytes before returning, so
		 * the caller may reuse the buffer at once */
		std::shared_ptr<std::vector<char>> stage =
			std::make_shared<std::vector<char>>(width * height);

		for (size_t r = 0; r < height; r++)
			memcpy(stage->data() + r * width, (const char *)src + r * sp, width);
		op.run = [=]() {
			for (size_t r = 0; r < height; r++)
				memcpy((char *)dst + r * dp, stage->data() + r * width, width);
		};
	} else {
		op.run = [=]() {
			for (size_t r = 0; r < height; r++)
				memcpy((char *)dst + r * dp, (const char *)src + r * sp, width);
		};
	}
	enqueue(s, std::move(op));
	if (da) {
		check_use(da, s, s->clock, true, true, fn);
		record_use(da, s, s->enq, true, fn);
	}
	if (sa) {
		check_use(sa, s, s->clock, false, true, fn);
		record_use(sa, s, s->enq, false, fn);
	}
	/* into pageable memory: CUDA returns once the copy is done */
	if (kind == cudaMemcpyDeviceToHost && !registered(dst, dspan))
		host_wait(s, s->enq, &s->clock);
	return cudaSuccess;
}

cudaError_t set(const char *fn, void *p, int v, size_t n, CUstream_st *s)
{
	if (!n)
		return cudaSuccess;
	Alloc *a = dev_range(fn, "destination", p, n);
	Op op{};

	op.kind = Op::RUN;
	op.what = fn;
	op.run = [=]() { memset(p, v, n); };
	enqueue(s, std::move(op));
	check_use(a, s, s->clock, true, true, fn);
	record_use(a, s, s->enq, true, fn);
	return cudaSuccess;
}

} // namespace

extern "C" {

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
	CUstream_st *s = S(NULL, "cudaMemcpy");
	cudaError_t e = copy2d("cudaMemcpy", dst, count, src, count, count, 1, kind, s);

	/* blocking: done when it returns */
	if (e == cudaSuccess)
		host_wait(s, s->enq, &s->clock);
	return e;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
			    cudaStream_t stream)
{
	return copy2d("cudaMemcpyAsync", dst, count, src, count, count, 1, kind,
		      S(stream, "cudaMemcpyAsync"));
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
			      size_t width, size_t height, enum cudaMemcpyKind kind,
			      cudaStream_t stream)
{
	return copy2d("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height, kind,
		      S(stream, "cudaMemcpy2DAsync"));
}

/* Asynchronous like CUDA's (device memory): queued on the legacy stream. */
cudaError_t cudaMemset(void *p, int value, size_t count)
{
	return set("cudaMemset", p, value, count, S(NULL, "cudaMemset"));
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t count, cudaStream_t stream)
{
	return set("cudaMemsetAsync", p, value, count, S(stream, "cudaMemsetAsync"));
}

/* ---- cuBLAS --------------------------------------------------------------------------------- */

cublasStatus_t cublasCreate(cublasHandle_t *h)
{
	read_env();
	*h = new cublasContext{ NULL, 1, g_curdev };
	return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h)
{
	if (!h || !h->live)
		return CUBLAS_STATUS_NOT_INITIALIZED;
	h->live = 0;
	delete h;
	return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t st)
{
	if (!h || !h->live)
		return CUBLAS_STATUS_NOT_INITIALIZED;
	if (!stream_ok(st))
		fatal("cublasSetStream: %p is not a live stream", (void *)st);
	h->st = st;
	return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t s)
{
	switch (s) {
	case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
	case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
	case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
	case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
	case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
	case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
	case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
	case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
	case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
	}
	return "unknown error";
}

} // extern "C"

namespace {

/* C = alpha op(A) op(B) + beta C, column-major, float32 in and out, fp32
 * products and sums (no TF32), each element's sum in order of k.  beta == 0:
 * C is not read (cuBLAS's rule: it may hold NaN). */
__attribute__((no_sanitize("address"), optimize("O2", "tree-vectorize"))) void sgemm_ref(int m, int n, int k, float alpha,
							  const float *A, int lda, const float *B,
							  int ldb, float beta, float *C, int ldc)
{
	std::vector<float> accv((size_t)m);
	float *acc = accv.data();

	for (int j = 0; j < n; j++) {
		std::fill(acc, acc + m, 0.0f);
		for (int p = 0; p < k; p++) {
			const float b = B[(size_t)j * ldb + p];
			const float *a = A + (size_t)p * lda;

			for (int i = 0; i < m; i++)
				acc[i] += a[i] * b;
		}
		float *c = C + (size_t)j * ldc;

		for (int i = 0; i < m; i++)
			c[i] = beta == 0.0f ? alpha * acc[i] : alpha * acc[i] + beta * c[i];
	}
}

} // namespace

extern "C" cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta,
				       cublasOperation_t tb, int m, int n, int k, const void *alpha,
				       const void *A, cudaDataType At, int lda, const void *B,
				       cudaDataType Bt, int ldb, const void *beta, void *C,
				       cudaDataType Ct, int ldc, cublasComputeType_t ct,
				       cublasGemmAlgo_t algo)
{
	const char *fn = "cublasGemmEx";

	if (!h || !h->live)
		return CUBLAS_STATUS_NOT_INITIALIZED;
	if (h->dev != g_curdev)
		fatal("%s: a handle of device %d while device %d is current", fn, h->dev, g_curdev);
	if (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T && ta != CUBLAS_OP_C)
		return CUBLAS_STATUS_INVALID_VALUE;
	if (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T && tb != CUBLAS_OP_C)
		return CUBLAS_STATUS_INVALID_VALUE;
	/* cuBLAS's rules: sizes >= 0, lda >= rows of A as stored, ... */
	int arows = ta == CUBLAS_OP_N ? m : k, brows = tb == CUBLAS_OP_N ? k : n;

	if (m < 0 || n < 0 || k < 0 || lda < std::max(1, arows) || ldb < std::max(1, brows) ||
	    ldc < std::max(1, m)) {
		note("%s: m %d n %d k %d lda %d ldb %d ldc %d break cuBLAS's rules (lda >= %d, "
		     "ldb >= %d, ldc >= %d)",
		     fn, m, n, k, lda, ldb, ldc, std::max(1, arows), std::max(1, brows),
		     std::max(1, m));
		return CUBLAS_STATUS_INVALID_VALUE;
	}
	if (ta != CUBLAS_OP_N || tb != CUBLAS_OP_N || At != CUDA_R_32F || Bt != CUDA_R_32F ||
	    Ct != CUDA_R_32F || (ct != CUBLAS_COMPUTE_32F && ct != CUBLAS_COMPUTE_32F_PEDANTIC) ||
	    (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP)) {
		note("%s: only OP_N x OP_N, CUDA_R_32F, CUBLAS_COMPUTE_32F[_PEDANTIC] are emulated",
		     fn);
		return CUBLAS_STATUS_NOT_SUPPORTED;
	}
	if (!alpha || !beta)
		return CUBLAS_STATUS_INVALID_VALUE;
	if (find_dev(alpha) || find_dev(beta))
		fatal("%s: alpha/beta are device pointers but the pointer mode is host", fn);
	if (!m || !n)
		return CUBLAS_STATUS_SUCCESS;
	/* scalars are read now (host pointer mode) */
	float al = *(const float *)alpha, be = *(const float *)beta;
	CUstream_st *s = S(h->st, fn);
	Alloc *aa = k ? dev_range(fn, "A", A, ((size_t)(k - 1) * lda + m) * 4) : nullptr;
	Alloc *ba = k ? dev_range(fn, "B", B, ((size_t)(n - 1) * ldb + k) * 4) : nullptr;
	Alloc *ca = dev_range(fn, "C", C, ((size_t)(n - 1) * ldc + m) * 4);
	Op op{};

	op.kind = Op::RUN;
	op.what = fn;
	op.run = [=]() {
		sgemm_ref(m, n, k, al, (const float *)A, lda, (const float *)B, ldb, be, (float *)C,
			  ldc);
	};
	enqueue(s, std::move(op));
	/* a GEMM knows what it reads and writes, like a copy */
	for (Alloc *a : { aa, ba })
		if (a) {
			check_use(a, s, s->clock, false, true, fn);
			record_use(a, s, s->enq, false, fn);
		}
	check_use(ca, s, s->clock, true, true, fn);
	record_use(ca, s, s->enq, true, fn);
	return CUBLAS_STATUS_SUCCESS;
}

extern "C" void emu_fail_next(const char *api, int kind)
{
	g_fail_api = api;
	g_fail_kind = kind;
}

extern "C" unsigned emu_failures(void)
{
	return g_failures;
}
