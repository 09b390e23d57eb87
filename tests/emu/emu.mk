# Host emulation of the CUDA backend (docs/GPU.md, "Host emulation"),
# included by the top-level Makefile.
#
#   make check-emu      build into build/emu/ (ASan+UBSan, -O1) the CUDA backend
#                       against the fake runtime of tests/emu, kvg_kern.cu as host
#                       C++; link it with the ASan+UBSan build's libraries and kvd
#                       (build/san-address-undefined, made first if need be: the
#                       core has no CUDA code, so a second ASan build of it was
#                       only time); and run the emulator's
#                       self-test, the two device tests and test_gpu_plan in the
#                       three thread schedules (EMU_ORDER=fwd, rev, rand;
#                       EMU_SEED=N), with two emulated devices (EMU_DEVICES=2);
#                       test_cuda_kvc only in EMU_KVC_ORDERS (below).
#                       kvg_cuda.c is built at -O0: an early read through a NULL
#                       pointer that -O2 moves past its check crashes there.
#
# Nothing here touches the objects of the other variants.

EMU_B     := build/emu
EMU_SEED  ?= 1
EMU_SAN   := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
EMU_INC   := -Itests/emu -I. -I$(EMU_B)/proto
EMU_DEFS  := -D_GNU_SOURCE -DKVC_CUDA=1 -DKVG_EMU
EMU_CFLAGS   := -O1 -g -std=c11 $(EMU_DEFS) $(WARN) -MMD -MP -pthread $(EMU_SAN) $(EMU_INC)
EMU_CXXFLAGS := -O1 -g -std=c++17 $(EMU_DEFS) -Wall -Wextra -Wno-unused-parameter \
		-Wno-unknown-pragmas -Werror -MMD -MP -pthread $(EMU_SAN) $(EMU_INC)

EMU_SAN_B      := build/san-address-undefined
EMU_CORE_LIBS  := $(EMU_SAN_B)/libkvdcore.a $(EMU_SAN_B)/libkvabi.a $(EMU_SAN_B)/libkvengine.a
EMU_CLIENT_SRC := $(filter-out gpu-client/kvg_nocuda.c,$(wildcard gpu-client/*.c))
EMU_RT_OBJ     := $(EMU_B)/obj/tests/emu/emu_runtime.o
EMU_CLIENT_OBJ := $(EMU_CLIENT_SRC:%.c=$(EMU_B)/obj/%.o) $(EMU_B)/obj/gpu-client/kvg_kern.o \
		  $(EMU_RT_OBJ)
EMU_TESTS      := $(EMU_B)/tests/test_emu $(EMU_B)/tests/test_cuda_kern $(EMU_B)/tests/test_cuda_kvc \
		  $(EMU_B)/tests/test_gpu_plan
EMU_TEST_OBJ   := $(EMU_TESTS:$(EMU_B)/tests/%=$(EMU_B)/tests/obj/%.o)

.PHONY: check-emu emu-core emu-build

emu-core:
	$(Q)$(MAKE) --no-print-directory SAN=address,undefined $(EMU_CORE_LIBS) $(EMU_SAN_B)/kvd
# In the ASan make itself these are its own targets, with their recipes.
ifneq ($(B),$(EMU_SAN_B))
$(EMU_CORE_LIBS) $(EMU_SAN_B)/kvd: emu-core ;
endif

$(EMU_B)/proto/kvd.pb-c.c $(EMU_B)/proto/kvd.pb-c.h &: proto/kvd.proto
	$(call msg,PROTOC,$<)
	$(Q)mkdir -p $(EMU_B)/proto
	$(Q)protoc-c --c_out=$(EMU_B)/proto -Iproto $<

$(EMU_CLIENT_OBJ) $(EMU_TEST_OBJ): | $(EMU_B)/proto/kvd.pb-c.h

$(EMU_B)/obj/gpu-client/kvg_cuda.o: EMU_ISA := -O0

$(EMU_B)/obj/%.o: %.c
	$(call msg,EMUCC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(EMU_CFLAGS) $(EMU_ISA) -c $< -o $@

# kvg_kern.cu as host C++ (kvg_launch.cuh's KVG_EMU branch).  Uninitialised
# locals get a pattern (0xfe bytes): the launchers' by-value argument
# structs are filled only as far as a launch needs, and stale pointers in
# the rest would look like uses of those allocations to the emulator; in a
# kernel, a read of an uninitialised local gives a wild value, not 0.
$(EMU_B)/obj/%.o: %.cu
	$(call msg,EMUCXX,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CXX) -x c++ $(EMU_CXXFLAGS) -ftrivial-auto-var-init=pattern -c $< -o $@

$(EMU_B)/obj/%.o: %.cc
	$(call msg,EMUCXX,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CXX) $(EMU_CXXFLAGS) -c $< -o $@

# test_cuda_kvc starts <dir of the test>/../kvd: the ASan+UBSan one.
$(EMU_B)/kvd: $(EMU_SAN_B)/kvd
	$(Q)mkdir -p $(dir $@)
	$(Q)cp $< $@

$(EMU_B)/tests/obj/%.o: tests/cuda/%.c
	$(call msg,EMUCC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(EMU_CFLAGS) -Itests/unit -Itests/integration -c $< -o $@

$(EMU_B)/tests/obj/%.o: tests/unit/%.c
	$(call msg,EMUCC,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(EMU_CFLAGS) -Itests/unit -c $< -o $@

# kvd-decode's flag parser is tested there too.
$(EMU_B)/tests/test_gpu_plan: $(EMU_B)/obj/gpu-client/decode/args.o

$(EMU_B)/tests/obj/test_emu.o: tests/emu/test_emu.cc
	$(call msg,EMUCXX,$<)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CXX) $(EMU_CXXFLAGS) -c $< -o $@

$(EMU_B)/tests/test_emu: $(EMU_B)/tests/obj/test_emu.o $(EMU_RT_OBJ)
	$(call msg,LD,$@)
	$(Q)$(CXX) $(EMU_SAN) $^ -lcmocka -o $@

$(EMU_B)/tests/%: $(EMU_B)/tests/obj/%.o $(EMU_CLIENT_OBJ) $(EMU_CORE_LIBS)
	$(call msg,LD,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CXX) $(EMU_SAN) $^ -lcmocka $(LDLIBS) -o $@

# Every test in every schedule; the tally gets one line per schedule.
# The kernels and the planner run in every schedule.  test_cuda_kvc, the
# whole client against a real kvd, takes about 4 minutes a schedule here: it
# runs in EMU_KVC_ORDERS (rand alone in `make test`, all three in
# `make test-long`).
EMU_KVC_ORDERS ?= rand
EMU_QUICK := $(filter-out $(EMU_B)/tests/test_cuda_kvc,$(EMU_TESTS))
#
# The schedules run at once: test_cuda_kvc keeps about one CPU busy (the
# client and the emulated devices, then kvd), so the others' tests, and
# make test's check-avx512-emu beside this, take the rest.
# What check-emu runs, built (make test builds it on every CPU before the
# stage that runs it beside the fuzz targets).
emu-build: $(EMU_B)/kvd $(EMU_TESTS)

check-emu: $(EMU_B)/kvd $(EMU_TESTS)
	$(Q)pids=; for o in rand fwd rev; do \
		case " $(EMU_KVC_ORDERS) " in *" $$o "*) t="$(EMU_TESTS)";; *) t="$(EMU_QUICK)";; esac; \
		EMU_DEVICES=2 EMU_ORDER=$$o EMU_SEED=$(EMU_SEED) sh tests/run.sh emu-$$o $$t & \
		pids="$$pids $$!"; \
	done; rc=0; for p in $$pids; do wait $$p || rc=1; done; exit $$rc

-include $(EMU_CLIENT_OBJ:.o=.d) $(EMU_TEST_OBJ:.o=.d)
