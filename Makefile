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
CFLAGS  += -std=c11 -D_GNU_SOURCE $(WARN) -MMD -MP -pthread -fno-plt -I. -Ikvd
LDLIBS  += -lm -pthread

ifneq ($(SAN),)
CFLAGS  += -fsanitize=$(SAN) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS += -fsanitize=$(SAN)
endif

# Per-ISA kernel files get their own flags; everything else stays baseline
# x86-64 so the binary runs anywhere and dispatch picks the kernels.
ISA_avx2   := -mavx2 -mfma -mf16c
ISA_avx512 := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c

CORE_SRC := $(filter-out kvd/main.c,$(wildcard kvd/*.c))
CORE_OBJ := $(CORE_SRC:%.c=$(B)/%.o)
BENCH_SRC := $(wildcard bench/*.c)
BENCH_OBJ := $(BENCH_SRC:%.c=$(B)/%.o)
TEST_SRC := $(wildcard tests/unit/test_*.c)
TEST_BIN := $(TEST_SRC:tests/unit/%.c=$(B)/tests/%)
TEST_COMMON := $(filter-out tests/unit/test_%.c,$(wildcard tests/unit/*.c))
TEST_COMMON_OBJ := $(TEST_COMMON:%.c=$(B)/%.o)
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=build/fuzz/%)

ifeq ($(V),0)
Q := @
msg = @printf '  %-6s %s\n' $(1) $(2);
else
Q :=
msg :=
endif

.PHONY: all deps test check check-plain test-all bench demo fuzz fuzz-smoke clean
.DEFAULT_GOAL := all
.SECONDARY:

all: $(B)/libkvdcore.a $(B)/kvbench $(TEST_BIN)

deps:
	$(Q)sh tools/deps.sh

$(B)/kvd/kern_avx2.o: EXTRA := $(ISA_avx2)
$(B)/kvd/kern_avx512.o: EXTRA := $(ISA_avx512)

$(B)/%.o: %.c
	$(call msg,CC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(CFLAGS) $(EXTRA) -c $< -o $@

$(B)/libkvdcore.a: $(CORE_OBJ)
	$(call msg,AR,$@)
	$(Q)rm -f $@ && ar rcs $@ $^

$(B)/kvbench: $(BENCH_OBJ) $(B)/libkvdcore.a
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $^ $(LDLIBS) -o $@

$(B)/tests/%: $(B)/tests/unit/%.o $(TEST_COMMON_OBJ) $(B)/libkvdcore.a
	$(call msg,LD,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(LDFLAGS) $^ -lcmocka $(LDLIBS) -o $@

# Fuzz targets always use clang's libFuzzer with ASan+UBSan, whatever SAN says.
FUZZ_FLAGS := -std=c11 -D_GNU_SOURCE -O1 -g -I. -Ikvd -fsanitize=fuzzer,address,undefined
build/fuzz/%: tests/fuzz/%.c $(CORE_SRC)
	$(call msg,FUZZ,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(FUZZ_CC) $(FUZZ_FLAGS) -Wno-unused-command-line-argument \
		$(ISA_avx512) $< $(filter-out %/kern_avx2.c %/kern_avx512.c,$(CORE_SRC)) \
		kvd/kern_avx2.c kvd/kern_avx512.c -lm -pthread -o $@

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
	$(Q)sh tests/run.sh --total
else
test: deps
	$(Q)sh tests/run.sh --reset
	$(Q)$(MAKE) --no-print-directory check
	$(Q)sh tests/run.sh --total
endif

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

-include $(CORE_OBJ:.o=.d) $(BENCH_OBJ:.o=.d) $(TEST_COMMON_OBJ:.o=.d) $(TEST_BIN:$(B)/tests/%=$(B)/tests/unit/%.d)
