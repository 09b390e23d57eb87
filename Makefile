# kvd — top-level build.
#
#   make            build the engine library, kvbench and the unit tests
#   make test       plain tests, then ASan+UBSan, then TSan, then a short fuzz run,
#                   then the CUDA backend on the host emulation (make check-emu)
#                   and the AVX-512 kernels on SIMDe (make check-avx512-emu)
#   make test SAN=address,undefined   (or SAN=thread): only that variant
#   make test-long  the same at full size everywhere (see test-long below)
#   make bench      the engine benchmark, JSON lines (bench/README in docs)
#   make demo       the main job (see README.md); SPILL=1: sessions 3x the memory budget
#   make fuzz       longer libFuzzer runs
#   make CUDA=0     leave the CUDA backend out (default: in when nvcc and cuBLAS are found)
#
# Objects go under build/ (build/san-<list>/ for sanitizer builds), so the
# variants never mix objects.

comma := ,
SAN      ?=
CC       ?= cc
FUZZ_CC  ?= clang
V        ?= 0

ifeq ($(SAN),)
B := build
else
B := build/san-$(subst $(comma),-,$(SAN))
endif

WARN    := -Wall -Wextra -Wstrict-prototypes -Wshadow -Wno-unused-parameter -Werror
CFLAGS  ?= -O2 -g
# -fPIC: the same objects go into libkvclient.so.
CFLAGS  += -std=c11 -D_GNU_SOURCE $(WARN) -MMD -MP -pthread -fPIC -I. -I$(B)/proto
LDLIBS  += -lhiredis -lprotobuf-c -linih -lsystemd -luring -lnuma -lisal -lxxhash -lmicrohttpd -lm -pthread

ifneq ($(SAN),)
# KVD_INVARIANTS: a broken ALWAYS()/NEVER() aborts (engine/invariant.h).
CFLAGS  += -fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=all -DKVD_INVARIANTS
LDFLAGS += -fsanitize=$(SAN)
endif

# CUDA (docs/GPU.md): the CUDA backend of libkvclient, build/kvd-decode, the
# device tests and `kvbench gpu`.  CUDA=auto turns it on when nvcc and
# cuBLAS's header are there; CUDA=0 turns it off; CUDA=1 insists.  Sanitizer
# builds leave it out: ASan/TSan and the CUDA runtime do not mix (device
# memory errors are compute-sanitizer's job), so SAN builds build exactly
# what a CUDA=0 build does.  The kvd daemon never links CUDA.
CUDA      ?= auto
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCH ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
	     -gencode arch=compute_90,code=compute_90
ifneq ($(SAN),)
CUDA_EN := 0
else ifeq ($(CUDA),0)
CUDA_EN := 0
else ifeq ($(CUDA),auto)
CUDA_EN := $(if $(and $(shell command -v $(NVCC) 2>/dev/null),$(wildcard $(CUDA_HOME)/include/cublas_v2.h)),1,0)
else
CUDA_EN := 1
endif
ifeq ($(CUDA_EN),1)
CFLAGS    += -DKVC_CUDA=1 -I$(CUDA_HOME)/include
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++
NVCCFLAGS ?= -O2 -lineinfo
NVCCFLAGS += -std=c++17 $(CUDA_ARCH) -MMD -MP -Werror all-warnings \
	     -Xcompiler -fPIC,-Wall,-Wextra,-Wno-unused-parameter,-Werror \
	     -I.
endif

# Per-ISA kernel files get their own flags; everything else stays baseline
# x86-64 so the binary runs anywhere and dispatch picks the kernels.
ISA_avx2   := -mavx2 -mfma -mf16c
ISA_avx512 := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c

PROTO_C  := $(B)/proto/kvd.pb-c.c
# Three libraries, one per layer (docs/ARCHITECTURE.md, "Module map"): the engine
# (the math both sides run, and the leaf utilities), the ABI (rings and the
# control-plane codec, which the client links too) and the daemon's core.
ENGINE_SRC := $(wildcard engine/*.c)
ABI_SRC    := $(wildcard shm/*.c proto/*.c)
DAEMON_SRC := $(filter-out kvd/main.c,$(wildcard kvd/*.c kvd/store/*.c))
ENGINE_OBJ := $(ENGINE_SRC:%.c=$(B)/obj/%.o)
ABI_OBJ    := $(ABI_SRC:%.c=$(B)/obj/%.o) $(B)/proto/kvd.pb-c.o
DAEMON_OBJ := $(DAEMON_SRC:%.c=$(B)/obj/%.o)
CORE_SRC := $(DAEMON_SRC) $(ABI_SRC) $(ENGINE_SRC)
CORE_OBJ := $(DAEMON_OBJ) $(ABI_OBJ) $(ENGINE_OBJ)
# Link order: a library before the ones it calls.
KVD_LIBS    := $(B)/libkvdcore.a $(B)/libkvabi.a $(B)/libkvengine.a
CLIENT_LIBS := $(B)/libkvabi.a $(B)/libkvengine.a
# kvg_cuda.c + kvg_hash.c + kvg_kern.cu are the CUDA backend; kvg_nocuda.c
# stands in for them without CUDA.
ifeq ($(CUDA_EN),1)
CLIENT_SRC := $(filter-out gpu-client/kvg_nocuda.c,$(wildcard gpu-client/*.c))
CLIENT_CU  := $(wildcard gpu-client/*.cu)
DECODE_LIB := gpu-client/decode/args.c gpu-client/decode/run.c
DECODE_CU  := $(wildcard gpu-client/decode/*.cu)
else
CLIENT_SRC := $(filter-out gpu-client/kvg_cuda.c gpu-client/kvg_hash.c,$(wildcard gpu-client/*.c))
CLIENT_CU  :=
DECODE_LIB := gpu-client/decode/args.c
DECODE_CU  :=
endif
CLIENT_OBJ := $(CLIENT_SRC:%.c=$(B)/obj/%.o) $(CLIENT_CU:%.cu=$(B)/obj/%.o)
# The decode driver's core, shared by build/kvd-decode and `kvbench gpu`.
DECODE_OBJ := $(DECODE_LIB:%.c=$(B)/obj/%.o) $(DECODE_CU:%.cu=$(B)/obj/%.o)
BENCH_SRC := $(wildcard bench/*.c)
BENCH_OBJ := $(BENCH_SRC:%.c=$(B)/obj/%.o)
TEST_SRC := $(wildcard tests/unit/test_*.c tests/stress/test_*.c tests/integration/test_*.c)
ifeq ($(CUDA_EN),1)
TEST_SRC += $(wildcard tests/cuda/test_*.c)
endif
TEST_BIN := $(addprefix $(B)/tests/,$(notdir $(TEST_SRC:.c=)))
TEST_COMMON := $(filter-out tests/unit/test_%.c,$(wildcard tests/unit/*.c))
TEST_OBJ := $(addprefix $(B)/tests/obj/,$(notdir $(TEST_SRC:.c=.o)))
TEST_COMMON_OBJ := $(TEST_COMMON:%.c=$(B)/obj/%.o)
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=build/fuzz/%)

ifeq ($(V),0)
Q := @
msg = @printf '  %-6s %s\n' $(1) $(2);
else
Q :=
msg :=
endif

.PHONY: all deps test check check-unit check-exports check-modmap check-layers bench demo fuzz fuzz-smoke clean
.PHONY: install check-install
.DEFAULT_GOAL := all
.SECONDARY:

all: $(KVD_LIBS) $(B)/kvd $(B)/libkvclient.so $(B)/kvbench $(B)/kvd-decode $(B)/kvctl $(TEST_BIN)

$(B)/proto/kvd.pb-c.c $(B)/proto/kvd.pb-c.h: proto/kvd.proto
	$(call msg,PROTOC,$<)
	$(Q)mkdir -p $(B)/proto
	$(Q)protoc-c --c_out=$(B)/proto -Iproto $<

# Everything may include the generated header: generate it first.
$(CORE_OBJ) $(CLIENT_OBJ) $(BENCH_OBJ) $(TEST_OBJ) $(DECODE_OBJ) $(B)/obj/gpu-client/decode/main.o: | $(B)/proto/kvd.pb-c.h

$(B)/proto/kvd.pb-c.o: $(B)/proto/kvd.pb-c.c
	$(call msg,CC,$<)
	$(Q)$(CC) $(filter-out -Wshadow -Wstrict-prototypes,$(CFLAGS)) -c $< -o $@

deps:
	$(Q)sh tools/deps.sh

$(B)/obj/engine/kern_avx2.o: EXTRA := $(ISA_avx2)
# The revision kvd_build_info{git=...} reports, read from .git without running
# git ("unknown" outside a checkout); `make GIT_REV=...` overrides.
GIT_REV ?= $(shell r=$$(sed -n 's/^ref: //p' .git/HEAD 2>/dev/null); \
	{ if [ -n "$$r" ]; then cat .git/$$r 2>/dev/null || awk -v r="$$r" '$$2 == r {print $$1}' .git/packed-refs; \
	  else cat .git/HEAD; fi; } 2>/dev/null | cut -c1-12)
$(B)/obj/kvd/metrics.o: EXTRA := -DKVD_GIT_REV='"$(or $(GIT_REV),unknown)"'
$(B)/obj/engine/kern_avx512.o: EXTRA := $(ISA_avx512)
$(B)/obj/engine/kern_avx512vnni.o: EXTRA := $(ISA_avx512) -mavx512vnni
$(B)/obj/engine/kern_amx.o: EXTRA := $(ISA_avx512) -mamx-tile -mamx-int8
ifeq ($(SAN),thread)
# TSan leaves the kernel files (SimHash, scoring, gathers) uninstrumented:
# they read rows that the store published before the task was queued and
# write task-private outputs, and their instrumented loads were most of the
# TSan suite's time.  Every handoff around them (the pool's queue, segment
# references, the store's writes) stays instrumented.
# So does the synthetic workload generator, the tests' data rather than
# kvd's code: its threads fill disjoint blocks of arrays it allocated and are
# joined before it returns, and instrumented it took 2.5 times as long in
# most integration tests.
KERN_OBJ := $(patsubst %,$(B)/obj/engine/kern_%.o,scalar avx2 avx512 avx512vnni amx) \
	    $(B)/obj/engine/synth.o
$(KERN_OBJ): CFLAGS := $(filter-out -fsanitize=thread,$(CFLAGS))
endif
ifneq ($(SAN),)
# -O1: at -O2 the sanitizers' instrumentation of the unrolled AVX-512 kernels
# took three minutes a file, most of a sanitizer build.
$(B)/obj/engine/kern_avx512.o $(B)/obj/engine/kern_avx512vnni.o $(B)/obj/engine/kern_amx.o: EXTRA += -O1
endif

$(B)/obj/%.o: %.c
	$(call msg,CC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS) $(EXTRA) -c $< -o $@

$(B)/obj/%.o: %.cu
	$(call msg,NVCC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(B)/libkvdcore.a: $(DAEMON_OBJ)
	$(call msg,AR,$@)
	$(Q)rm -f $@ && ar rcs $@ $^

$(B)/libkvabi.a: $(ABI_OBJ)
	$(call msg,AR,$@)
	$(Q)rm -f $@ && ar rcs $@ $^

$(B)/libkvengine.a: $(ENGINE_OBJ)
	$(call msg,AR,$@)
	$(Q)rm -f $@ && ar rcs $@ $^

$(B)/kvd: $(B)/obj/kvd/main.o $(KVD_LIBS)
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@

# libkvclient exports kvc_* only (gpu-client/libkvclient.map).  Its soname
# is libkvclient.so.$(KVC_SOVERSION): bump it on an incompatible change to kvc.h.
KVC_SOVERSION := 3
KVC_VERSION   := 3.1.0
$(B)/libkvclient.so: $(CLIENT_OBJ) $(CLIENT_LIBS) gpu-client/libkvclient.map
	$(call msg,LD,$@)
	$(Q)$(CC) -shared $(LDFLAGS) -Wl,--version-script=gpu-client/libkvclient.map \
		-Wl,-soname,libkvclient.so.$(KVC_SOVERSION) \
		$(CLIENT_OBJ) $(CLIENT_LIBS) $(LDLIBS) $(CUDA_LIBS) -o $@

$(B)/kvbench: $(BENCH_OBJ) $(DECODE_OBJ) $(CLIENT_OBJ) $(B)/obj/tests/unit/rcluster.o $(KVD_LIBS)
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $^ $(LDLIBS) $(CUDA_LIBS) -o $@

# The end-to-end decode driver (docs/GPU.md); without CUDA a stub that says so.
$(B)/kvd-decode: $(B)/obj/gpu-client/decode/main.o $(DECODE_OBJ) $(CLIENT_OBJ) $(CLIENT_LIBS)
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $^ $(LDLIBS) $(CUDA_LIBS) -o $@

# kvctl, the admin CLI (docs/kvctl.1): the control-plane codec, nothing else.
KVCTL_OBJ := $(B)/obj/tools/kvctl/kvctl.o
$(KVCTL_OBJ): | $(B)/proto/kvd.pb-c.h
$(B)/kvctl: $(KVCTL_OBJ) $(CLIENT_LIBS)
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@

# Test binaries link the client objects statically (they test internals too).
$(B)/tests/%: $(B)/tests/obj/%.o $(TEST_COMMON_OBJ) $(CLIENT_OBJ) $(KVD_LIBS)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(LDFLAGS) $^ -lcmocka $(LDLIBS) $(CUDA_LIBS) -o $@

# kvd-decode's flag parser is tested on the CPU.
$(B)/tests/test_gpu_plan: $(B)/obj/gpu-client/decode/args.o

$(B)/tests/obj/%.o: tests/unit/%.c
	$(call msg,CC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS) -Itests/unit -c $< -o $@
$(B)/tests/obj/%.o: tests/stress/%.c
	$(call msg,CC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS) -Itests/unit -c $< -o $@
$(B)/tests/obj/%.o: tests/integration/%.c
	$(call msg,CC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS) -Itests/unit -c $< -o $@
$(B)/tests/obj/%.o: tests/cuda/%.c
	$(call msg,CC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS) -Itests/unit -Itests/integration -c $< -o $@

# Fuzz targets always use clang's libFuzzer with ASan+UBSan, whatever SAN says.
# The engine is compiled once into build/fuzz/obj with the fuzzer's
# instrumentation (not its main); only the per-ISA kernel files get their ISA
# flags, as in every other build, so a fuzz target runs on any x86-64 and
# dispatch picks the kernels the CPU has.
FUZZ_FLAGS := -std=c11 -D_GNU_SOURCE -O1 -g -I. -Ibuild/proto \
	-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined \
	-DKVD_INVARIANTS
FUZZ_OBJ := $(CORE_SRC:%.c=build/fuzz/obj/%.o) build/fuzz/obj/kvd.pb-c.o
FUZZ_LIBS := -lhiredis -lprotobuf-c -linih -lsystemd -luring -lnuma -lisal -lxxhash -lmicrohttpd -lm -pthread

build/fuzz/obj/engine/kern_avx2.o: FUZZ_ISA := $(ISA_avx2)
build/fuzz/obj/engine/kern_avx512.o: FUZZ_ISA := $(ISA_avx512)
build/fuzz/obj/engine/kern_avx512vnni.o: FUZZ_ISA := $(ISA_avx512) -mavx512vnni
build/fuzz/obj/engine/kern_amx.o: FUZZ_ISA := $(ISA_avx512) -mamx-tile -mamx-int8

# No input a fuzz target decodes reaches a kernel: the per-ISA files go in
# uninstrumented, which takes seconds where ASan+UBSan took minutes.
FUZZ_KERN := $(patsubst %,build/fuzz/obj/engine/kern_%.o,avx2 avx512 avx512vnni amx)
$(FUZZ_KERN): build/fuzz/obj/%.o: %.c build/proto/kvd.pb-c.h
	$(call msg,FUZZCC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(FUZZ_CC) $(filter-out -fsanitize=%,$(FUZZ_FLAGS)) $(FUZZ_ISA) -MMD -MP -c $< -o $@

build/fuzz/obj/%.o: %.c build/proto/kvd.pb-c.h
	$(call msg,FUZZCC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(FUZZ_CC) $(FUZZ_FLAGS) $(FUZZ_ISA) -MMD -MP -c $< -o $@

build/fuzz/obj/kvd.pb-c.o: build/proto/kvd.pb-c.c
	$(call msg,FUZZCC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(FUZZ_CC) $(FUZZ_FLAGS) -c $< -o $@

build/fuzz/%: tests/fuzz/%.c $(FUZZ_OBJ)
	$(call msg,FUZZ,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(FUZZ_CC) $(FUZZ_FLAGS) -fsanitize=fuzzer $< $(FUZZ_OBJ) $(FUZZ_LIBS) -o $@

# `check` builds and runs the unit tests of the current variant.  T=NAME
# (shm, test_shm, or a list: T="wire store") builds and runs only those
# binaries, in any variant (SAN=..., B=...); the daemon and kvctl come too,
# since the tests that start them look for them beside build/tests/.
ifneq ($(T),)
CHECK_BIN := $(foreach t,$(T),$(B)/tests/test_$(patsubst test_%,%,$(basename $(notdir $(t)))))
ifneq ($(filter check,$(MAKECMDGOALS)),)
ifneq ($(filter-out $(TEST_BIN),$(CHECK_BIN)),)
$(error T=$(T): no test $(notdir $(filter-out $(TEST_BIN),$(CHECK_BIN))); there are: $(patsubst test_%,%,$(notdir $(TEST_BIN))))
endif
endif
check: $(CHECK_BIN) $(B)/kvd $(B)/kvctl
	$(Q)sh tests/run.sh $(B)/tests $(CHECK_BIN)
else ifeq ($(SAN),)
check: all
	$(Q)sh tests/run.sh $(B)/tests $(TEST_BIN)
else
# A sanitizer build runs the tests: kvbench and kvd-decode, which no test
# starts, were a minute of its compile and are checked by the plain build.
check: $(TEST_BIN) $(B)/kvd $(B)/kvctl
	$(Q)sh tests/run.sh $(B)/tests $(TEST_BIN)
endif

# The stages build with one job per CPU, and tests/run.sh runs one test
# binary per CPU at once.  The fuzz run and both emulators share a stage:
# the emulated test_cuda_kvc keeps one CPU busy for minutes, and the fuzz
# targets and the SIMDe kernels build and run on the other (what check-emu
# runs is built first on every CPU, so test_cuda_kvc starts at once).
TEST_J ?= -j$(shell nproc 2>/dev/null || echo 2)
ifeq ($(SAN),)
test: deps
	$(Q)sh tests/run.sh --reset
	$(Q)sh tests/run.sh --stage plain $(MAKE) $(TEST_J) --no-print-directory check
	$(Q)sh tests/run.sh --stage asan+ubsan $(MAKE) $(TEST_J) --no-print-directory check SAN=address,undefined
	$(Q)sh tests/run.sh --stage tsan $(MAKE) $(TEST_J) --no-print-directory check SAN=thread
	$(Q)sh tests/run.sh --stage fuzz+emulators sh -c '$(MAKE) $(TEST_J) --no-print-directory emu-build && \
		$(MAKE) $(TEST_J) --no-print-directory check-emu fuzz-smoke check-avx512-emu'
	$(Q)sh tests/run.sh --stage unit+exports $(MAKE) $(TEST_J) --no-print-directory check-unit check-exports check-modmap check-layers
	$(Q)sh tests/run.sh --stage check-install $(MAKE) $(TEST_J) --no-print-directory check-install
	$(Q)sh tests/run.sh --stage check-python $(MAKE) $(TEST_J) --no-print-directory check-python
	$(Q)sh tests/run.sh --total
else
test: deps
	$(Q)sh tests/run.sh --reset
	$(Q)sh tests/run.sh --stage $(SAN) $(MAKE) $(TEST_J) --no-print-directory check
	$(Q)sh tests/run.sh --total
endif

# The long runs, one command away: every test at full size in the sanitizer
# builds too (KVD_TEST_FULL, tests/unit/testutil.h), test_cuda_kvc in all
# three emulated schedules, and five minutes of fuzzing per decoder.
.PHONY: test-long
test-long:
	$(Q)KVD_TEST_FULL=1 $(MAKE) --no-print-directory test EMU_KVC_ORDERS="fwd rev rand" FUZZ_SECONDS=300

# systemd/kvd.service through systemd-analyze verify (tools/verify-unit.sh).
check-unit:
	$(Q)sh tools/verify-unit.sh systemd && echo "1 0 0" >>build/test-tally || \
		{ rc=$$?; [ $$rc = 77 ] && echo "0 0 1" >>build/test-tally || { echo "0 1 0" >>build/test-tally; exit 1; }; }

# libkvclient.so exports kvc_* and nothing else.
check-exports: $(B)/libkvclient.so
	$(Q)bad=$$(nm -D --defined-only $< | awk '{print $$3}' | grep -v '^kvc_'); \
	if [ -z "$$bad" ]; then echo "exports: libkvclient.so exports only kvc_*"; echo "1 0 0" >>build/test-tally; \
	else echo "exports: libkvclient.so also exports: $$bad"; echo "0 1 0" >>build/test-tally; exit 1; fi

# The module map of docs/ARCHITECTURE.md against nm on the objects: every
# module has a row, each row's callers are the modules that call it, and no
# files call each other round a circle.
check-modmap: $(CORE_OBJ) $(B)/obj/kvd/main.o
	$(Q)python3 tools/check-modmap.py --doc docs/ARCHITECTURE.md --obj $(B)/obj && \
		echo "1 0 0" >>build/test-tally || { echo "0 1 0" >>build/test-tally; exit 1; }

# The store and the engine include no daemon header, libkvabi nothing above
# it (tools/check-layers.sh).
check-layers:
	$(Q)sh tools/check-layers.sh && echo "1 0 0" >>build/test-tally || \
		{ echo "0 1 0" >>build/test-tally; exit 1; }

# The Python package (python/, python/README.md): pytest against this
# build's libkvclient.so and a real kvd, the example decode included.
.PHONY: check-python
check-python: $(B)/libkvclient.so $(B)/kvd
	$(Q)sh python/tests/run.sh $(B)

# `make install` (docs/OPERATIONS.md, "Install"): FHS paths under PREFIX,
# staged under DESTDIR.  The systemd directories default to PREFIX's
# (systemd searches /usr/local/lib/systemd/system, .../sysusers.d and
# .../tmpfiles.d too); packagers pass e.g.
#   SYSTEMDUNITDIR=$$(pkg-config --variable=systemdsystemunitdir systemd)
# The unit is installed with ExecStart and the config path rewritten to
# BINDIR and SYSCONFDIR; an existing kvd.conf is never overwritten.
PREFIX         ?= /usr/local
DESTDIR        ?=
BINDIR         ?= $(PREFIX)/bin
LIBDIR         ?= $(PREFIX)/lib
INCLUDEDIR     ?= $(PREFIX)/include
DATADIR        ?= $(PREFIX)/share
MANDIR         ?= $(DATADIR)/man
DOCDIR         ?= $(DATADIR)/doc/kvd
PKGCONFIGDIR   ?= $(LIBDIR)/pkgconfig
SYSCONFDIR     ?= /etc
SYSTEMDUNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR    ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR    ?= $(PREFIX)/lib/tmpfiles.d

install: $(B)/kvd $(B)/kvctl $(B)/libkvclient.so
	$(call msg,INSTALL,$(DESTDIR)$(PREFIX))
	$(Q)install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR)/kvd \
		$(DESTDIR)$(PKGCONFIGDIR) $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man8 \
		$(DESTDIR)$(DOCDIR) $(DESTDIR)$(SYSTEMDUNITDIR) $(DESTDIR)$(SYSUSERSDIR) \
		$(DESTDIR)$(TMPFILESDIR) $(DESTDIR)$(SYSCONFDIR)/kvd
	$(Q)install -m 755 $(B)/kvd $(B)/kvctl $(DESTDIR)$(BINDIR)/
	$(Q)install -m 755 $(B)/libkvclient.so $(DESTDIR)$(LIBDIR)/libkvclient.so.$(KVC_VERSION)
	$(Q)ln -sf libkvclient.so.$(KVC_VERSION) $(DESTDIR)$(LIBDIR)/libkvclient.so.$(KVC_SOVERSION)
	$(Q)ln -sf libkvclient.so.$(KVC_SOVERSION) $(DESTDIR)$(LIBDIR)/libkvclient.so
	$(Q)install -m 644 gpu-client/kvc.h $(DESTDIR)$(INCLUDEDIR)/kvd/kvc.h
	$(Q)printf '%s\n' 'prefix=$(PREFIX)' 'libdir=$(LIBDIR)' 'includedir=$(INCLUDEDIR)' '' \
		'Name: libkvclient' \
		'Description: kvd client library: KV-cache offload for LLM decoding (#include <kvd/kvc.h>)' \
		'URL: file://$(DOCDIR)/PROTOCOL.md' 'Version: $(KVC_VERSION)' \
		'Cflags: -I$${includedir}' 'Libs: -L$${libdir} -lkvclient' \
		>$(DESTDIR)$(PKGCONFIGDIR)/libkvclient.pc
	$(Q)chmod 644 $(DESTDIR)$(PKGCONFIGDIR)/libkvclient.pc
	$(Q)install -m 644 docs/kvctl.1 $(DESTDIR)$(MANDIR)/man1/kvctl.1
	$(Q)install -m 644 docs/kvd.8 $(DESTDIR)$(MANDIR)/man8/kvd.8
	$(Q)install -m 644 README.md docs/PROTOCOL.md docs/OPERATIONS.md $(DESTDIR)$(DOCDIR)/
	$(Q)sed -e 's|/usr/local/bin/kvd|$(BINDIR)/kvd|g' -e 's|/etc/kvd/|$(SYSCONFDIR)/kvd/|g' \
		-e 's|/usr/local/share/doc/kvd/|$(DOCDIR)/|g' systemd/kvd.service \
		>$(DESTDIR)$(SYSTEMDUNITDIR)/kvd.service
	$(Q)chmod 644 $(DESTDIR)$(SYSTEMDUNITDIR)/kvd.service
	$(Q)install -m 644 systemd/kvd.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvd.conf
	$(Q)install -m 644 systemd/kvd.tmpfiles $(DESTDIR)$(TMPFILESDIR)/kvd.conf
	$(Q)[ -e $(DESTDIR)$(SYSCONFDIR)/kvd/kvd.conf ] || \
		install -m 644 systemd/kvd.conf $(DESTDIR)$(SYSCONFDIR)/kvd/kvd.conf

# make install into a scratch DESTDIR, then build and run a program against
# the installed tree with pkg-config (tests/check-install.sh).
check-install: $(B)/kvd $(B)/kvctl $(B)/libkvclient.so
	$(Q)sh tests/check-install.sh $(B) && echo "1 0 0" >>build/test-tally || \
		{ rc=$$?; [ $$rc = 77 ] && echo "0 0 1" >>build/test-tally || { echo "0 1 0" >>build/test-tally; exit 1; }; }

FUZZ_SECONDS ?= 10
fuzz-smoke: $(FUZZ_BIN)
	$(Q)sh tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_BIN)

fuzz: FUZZ_SECONDS := 300
fuzz: deps $(FUZZ_BIN)
	$(Q)sh tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_BIN)

bench: deps all
	$(B)/kvbench attn --json

# SPILL=1: more sessions than the memory budget holds, through the spill tier.
demo: deps all
	$(B)/kvbench demo $(if $(SPILL),--spill)

clean:
	rm -rf build

# check-emu: the CUDA backend on the host emulation (tests/emu/emu.mk)
include tests/emu/emu.mk
# check-avx512-emu: the AVX-512 kernels on SIMDe (tests/simd/simd.mk)
include tests/simd/simd.mk

-include $(CORE_OBJ:.o=.d) $(CLIENT_OBJ:.o=.d) $(BENCH_OBJ:.o=.d) $(TEST_COMMON_OBJ:.o=.d) \
	$(TEST_OBJ:.o=.d) $(KVCTL_OBJ:.o=.d) $(B)/obj/kvd/main.d $(DECODE_OBJ:.o=.d) $(B)/obj/gpu-client/decode/main.d \
	$(FUZZ_OBJ:.o=.d)
