# The AVX-512 kernels on a host without AVX-512 (tests/simd/avx512_simde.h),
# included by the top-level Makefile.
#
#   make check-avx512-emu   build kern.c (every variant supported), kern_avx512.c
#                           and kern_avx512vnni.c on SIMDe into build/emu512/,
#                           under ASan+UBSan, and run test_kern there: each
#                           AVX-512 table against the scalar reference, as on
#                           an AVX-512 machine.  SIMDe's loads are memcpy, so
#                           ASan also sees a vector load past a row's end (a
#                           half chunk read whole failed it).
#
# It checks what the code computes, not how fast; a real AVX-512 host runs
# the ordinary test_kern on the real instructions.

E512_B    := build/emu512
E512_SRC  := engine/kern.c engine/kern_avx512.c engine/kern_avx512vnni.c
E512_OBJ  := $(E512_SRC:engine/%.c=$(E512_B)/obj/%.o)
E512_SAN    := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
# -O0: SIMDe under ASan+UBSan took 222 s a file to compile at -O1 (57 s at
# -O0), far more than the test then runs.
E512_CFLAGS := $(filter-out -Wshadow -O2,$(CFLAGS)) -O0 $(ISA_avx2) $(E512_SAN) -DKVD_KERN_EMU

.PHONY: check-avx512-emu

$(E512_B)/obj/kern.o: engine/kern.c
	$(call msg,CC,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(E512_CFLAGS) -c $< -o $@

$(E512_B)/obj/%.o: engine/%.c tests/simd/avx512_simde.h
	$(call msg,CC,$@)
	$(Q)mkdir -p $(dir $@)
	$(Q)$(CC) $(E512_CFLAGS) -include tests/simd/avx512_simde.h -c $< -o $@

# The objects above come first, so the archive's own kern*.o stay out.
$(E512_B)/test_kern: $(B)/tests/obj/test_kern.o $(E512_OBJ) $(TEST_COMMON_OBJ) $(KVD_LIBS)
	$(call msg,LD,$@)
	$(Q)$(CC) $(LDFLAGS) $(E512_SAN) $^ -lcmocka $(LDLIBS) -o $@

check-avx512-emu: $(E512_B)/test_kern
	$(Q)sh tests/run.sh $(E512_B) $(E512_B)/test_kern

-include $(E512_OBJ:.o=.d)
