# kvd — top-level build.
#
#   make            build the engine library, kvbench and the unit tests
#   make test       plain tests, then ASan+UBSan, then TSan, then a short fuzz run
#   make test SAN=address,undefined   (or SAN=thread): only that variant
#   make bench      the engine benchmark, JSON lines (bench/README in docs)
#   make demo       the main job (see README.md)
#   make fuzz       longer libFuzzer runs
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
CFLAGS  += -std=c11 -D_GNU_SOURCE $(WARN) -MMD -MP -pthread -fPIC -I. -Ikvd -Ishm -Iproto -Igpu-client -I$(B)/proto
LDLIBS  += -lprotobuf-c -linih -lsystemd -luring -lnuma -lisal -lxxhash -lm -pthread

ifneq ($(SAN),)
CFLAGS  += -fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS += -fsanitize=$(SAN)
endif

# Per-ISA kernel files get their own flags; everything else stays baseline
# x86-64 so the binary runs anywhere and dispatch picks the kernels.
ISA_avx2   := -mavx2 -mfma -mf16c
ISA_avx512 := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c

PROTO_C  := $(B)/proto/kvd.pb-c.c
CORE_SRC := $(filter-out kvd/main.c,$(wildcard kvd/*.c)) $(wildcard shm/*.c)
CORE_OBJ := $(CORE_SRC:%.c=$(B)/obj/%.o) $(B)/proto/kvd.pb-c.o
CLIENT_SRC := $(wildcard gpu-client/*.c)
CLIENT_OBJ := $(CLIENT_SRC:%.c=$(B)/obj/%.o)
BENCH_SRC := $(wildcard bench/*.c)
BENCH_OBJ := $(BENCH_SRC:%.c=$(B)/obj/%.o)
TEST_SRC := $(wildcard tests/unit/test_*.c tests/stress/test_*.c tests/integration/test_*.c)
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

.PHONY: all deps test check check-unit check-exports bench demo fuzz fuzz-smoke clean
.DEFAULT_GOAL := all
.SECONDARY:

all: $(B)/libkvdcore.a $(B)/kvd $(B)/libkvclient.so $(B)/kvbench $(TEST_BIN)

$(B)/proto/kvd.pb-c.c $(B)/proto/kvd.pb-c.h: proto/kvd.proto
	$(call msg,PROTOC,$<)
	$(Q)mkdir -p $(B)/proto
	$(Q)protoc-c --c_out=$(B)/proto -Iproto $<

# Everything may include the generated header: generate it first.
$(CORE_OBJ) $(CLIENT_OBJ) $(BENCH_OBJ) $(TEST_OBJ): | $(B)/proto/kvd.pb-c.h

$(B)/proto/kvd.pb-c.o: $(B)/proto/kvd.pb-c.c
	$(call msg,CC,$<)
	$(Q)$(CC) $(filter-out -Wshadow -Wstrict-prototypes,$(CFLAGS)) -c $< -o $@

deps:
	$(Q)sh tools/deps.sh

$(B)/obj/kvd/kern_avx2.o: EXTRA := $(ISA_avx2)
$(B)/obj/kvd/kern_avx512.o: EXTRA := $(ISA_avx512)

$(B)/obj/%.o: %.c
	$(call msg,CC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS) $(EXTRA) -c $< -o $@

$(B)/libkvdcore.a: $(CORE_OBJ)
	$(call msg,AR,$@)
	$(Q)rm -f $@ && ar rcs $@ $^

$(B)/kvd: $(B)/obj/kvd/main.o $(B)/libkvdcore.a
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@

# libkvclient exports kvc_* only (gpu-client/libkvclient.map).
$(B)/libkvclient.so: $(CLIENT_OBJ) $(B)/libkvdcore.a gpu-client/libkvclient.map
	$(call msg,LD,$@)
	$(Q)$(CC) -shared $(LDFLAGS) -Wl,--version-script=gpu-client/libkvclient.map \
		$(CLIENT_OBJ) $(B)/libkvdcore.a $(LDLIBS) -o $@

$(B)/kvbench: $(BENCH_OBJ) $(CLIENT_OBJ) $(B)/libkvdcore.a
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@

# Test binaries link the client objects statically (they test internals too).
$(B)/tests/%: $(B)/tests/obj/%.o $(TEST_COMMON_OBJ) $(CLIENT_OBJ) $(B)/libkvdcore.a
	$(call msg,LD,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(LDFLAGS) $^ -lcmocka $(LDLIBS) -o $@

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

# Fuzz targets always use clang's libFuzzer with ASan+UBSan, whatever SAN says.
FUZZ_FLAGS := -std=c11 -D_GNU_SOURCE -O1 -g -I. -Ikvd -Ishm -Iproto -Igpu-client -Ibuild/proto \
	-fsanitize=fuzzer,address,undefined
build/fuzz/%: tests/fuzz/%.c $(CORE_SRC) build/proto/kvd.pb-c.c
	$(call msg,FUZZ,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(FUZZ_CC) $(FUZZ_FLAGS) -Wno-unused-command-line-argument \
		$(ISA_avx512) $< $(CORE_SRC) build/proto/kvd.pb-c.c \
		-lprotobuf-c -linih -lsystemd -luring -lnuma -lisal -lxxhash -lm -pthread -o $@

# `check` builds and runs the unit tests of the current variant.
check: all
	$(Q)sh tests/run.sh $(B)/tests $(TEST_BIN)

ifeq ($(SAN),)
test: deps
	$(Q)sh tests/run.sh --reset
	$(Q)$(MAKE) --no-print-directory check
	$(Q)$(MAKE) --no-print-directory check SAN=address,undefined
	$(Q)$(MAKE) --no-print-directory check SAN=thread
	$(Q)$(MAKE) --no-print-directory fuzz-smoke
	$(Q)$(MAKE) --no-print-directory check-unit check-exports
	$(Q)sh tests/run.sh --total
else
test: deps
	$(Q)sh tests/run.sh --reset
	$(Q)$(MAKE) --no-print-directory check
	$(Q)sh tests/run.sh --total
endif

# systemd/kvd.service through systemd-analyze verify (tools/verify-unit.sh).
check-unit:
	$(Q)sh tools/verify-unit.sh systemd && echo "1 0 0" >>build/test-tally || \
		{ rc=$$?; [ $$rc = 77 ] && echo "0 0 1" >>build/test-tally || { echo "0 1 0" >>build/test-tally; exit 1; }; }

# libkvclient.so exports kvc_* and nothing else.
check-exports: $(B)/libkvclient.so
	$(Q)bad=$$(nm -D --defined-only $< | awk '{print $$3}' | grep -v '^kvc_'); \
	if [ -z "$$bad" ]; then echo "exports: libkvclient.so exports only kvc_*"; echo "1 0 0" >>build/test-tally; \
	else echo "exports: libkvclient.so also exports: $$bad"; echo "0 1 0" >>build/test-tally; exit 1; fi

FUZZ_SECONDS ?= 10
fuzz-smoke: $(FUZZ_BIN)
	$(Q)sh tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_BIN)

fuzz: FUZZ_SECONDS := 300
fuzz: deps $(FUZZ_BIN)
	$(Q)sh tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_BIN)

bench: deps all
	$(B)/kvbench attn --json

demo: deps all
	$(B)/kvbench demo

clean:
	rm -rf build

-include $(CORE_OBJ:.o=.d) $(CLIENT_OBJ:.o=.d) $(BENCH_OBJ:.o=.d) $(TEST_COMMON_OBJ:.o=.d) \
	$(TEST_OBJ:.o=.d) $(B)/obj/kvd/main.d
