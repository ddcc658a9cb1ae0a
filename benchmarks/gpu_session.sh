#!/usr/bin/env bash
# A GPU session's device work (issue 16) in two calls of the device tool, each well inside its 10 minutes:
#
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh 1     # tests, ptx, embedding, loader (~6 min)
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh 2     # train, kernel settings, Nsight (~6 min)
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh check # after a kernel change (see below)
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh measure # check's core in ~335 s, leaving a
#                                                                    # 15-minute session time for a second call
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh tune    # after measure: loader, two sweeps and
#                                                                    # the segment pass's old setting profiled (235 s)
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh segment # the segment pass's settings on 5 shapes (210 s)
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh final   # after new defaults: tests, ptx, embedding,
#                                                                    # train, the profile (325 s)
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh dynamic # issue 42: dynamic tables and the host
#                                                                    # tier, tests and throughput (390 s)
#   RECLOOP_COMMIT=<short sha> bash benchmarks/gpu_session.sh fbgemm  # issue 39: FBGEMM side by side; carry
#                                                                    # .whl-fbgemm (fbgemm_wheel.py) (360 s)
#
# Each step runs under its own time limit, so one slow step cannot take the others' time; gpu_suite.py
# saves its JSON after every figure, so a step stopped at its limit keeps what it measured. Everything
# lands in $OUT (the device tool's folder that comes back), or ./gpu-out elsewhere. The limits come from
# the H100 calls of 2026-11-25 (benchmarks/RESULTS.md, "GPU proof, first run"): tests 40 s, ptx --quick
# 10 s, loader --quick 24 s; an embedding measurement took ~100 s while the tables were drawn on the host
# (now on the device), and the train step ran past 140 s at 4M rows (now 2M, both batches on one set).
# The device time of a session is 15 minutes in all: the limits add up to 375 s and 330 s, and each call
# cost 30-70 s more (start, transfers) on 2026-11-25; call 2 right after call 1 (warm for 30 s). The tests
# step now compiles a CUDA-graph training step too (tests/test_fit.py), hence its 120 s.
# Between the calls, here: mkdir -p gpu-in && cp <call 1's files_at>/gpu_suite.json gpu-in/ (ignored), and
# name gpu-in in call 2's carry, so that part 2 adds its steps to part 1's JSON.
set -u
part=${1:?which part: 1, 2, check, measure, tune, segment, final, dynamic, fbgemm, fbgemm-dynamic or fbgemm-half}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log=$OUT/log-$part.txt
suite=$OUT/gpu_suite.json
quiet='UserWarning|_warn_once|warnings.warn|return torch.sparse_coo'

step() {  # step LIMIT_SECONDS COMMAND...: run it under its limit, log it, say how long it took
    local limit=$1 began
    shift
    began=$(date +%s)
    echo "== $* (limit ${limit} s)" | tee -a "$log"
    timeout -k 5 "$limit" "$@" 2>&1 | grep --line-buffered -v -E "$quiet" | tee -a "$log"
    echo "== took $(( $(date +%s) - began )) s, exit ${PIPESTATUS[0]}" | tee -a "$log"
}

NCU_SECTIONS='--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats'
profile_passes() {  # profile_passes LIMIT: Nsight on one pass's forward, linearize, segment and split (the second
    # pass: the first compiles), Criteo-like fp32
    step "$1" bash -c 'exec ncu '"$NCU_SECTIONS"' -k "regex:_(forward|segment|split|linearize)_kernel" \
        --launch-skip 4 --launch-count 4 --csv --page details python3 benchmarks/profile_embedding.py > "$0"' \
        "$OUT/ncu_criteo_fp32.csv"
}
profile_segment_as_on_the_h200() {  # LIMIT: the segment pass as measured on 2026-11-26 (one run a program, a
    # program per item, no long-item path), for the side-by-side counters
    step "$1" bash -c 'exec ncu '"$NCU_SECTIONS"' -k "regex:_segment_kernel" --launch-skip 1 --launch-count 1 \
        --csv --page details python3 benchmarks/profile_embedding.py --set SEGMENT_RUNS=1 --set SEGMENT_WAVES=0 \
        --set SEGMENT_LONG_N=0 > "$0"' "$OUT/ncu_criteo_fp32_one_run.csv"
}

dynamic_steps() {  # dynamic_steps TESTS_LIMIT THROUGHPUT_LIMIT (issue 42): the dynamic tables' and the host tier's
    # gpu tests, then lookup + update throughput at the seeds' shape and a Criteo-like one
    step "$1" env PYTHONPATH=platform:kernels:. python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/test_dynamic_tables.py tests/test_host_tier.py
    step "$2" python3 benchmarks/dynamic_tables.py --part throughput --device cuda --rows 10000000 --dim 64 \
        --tables 1 --batch 16384 --threads 8 --json "$OUT/dynamic_tables_seed_shape.json"
    step "$2" python3 benchmarks/dynamic_tables.py --part throughput --device cuda --rows 2000000 --dim 128 \
        --tables 8 --batch 65536 --threads 8 --json "$OUT/dynamic_tables_criteo_like.json"
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$log"
if [ "$part" = check ]; then
    # after a kernel or loader change, on the merged JSON so far (carried in gpu-in/: after parts 1 and 2,
    # or benchmarks/results/gpu_suite.json): the tests, every embedding shape, the loader, the launch
    # settings on three shapes, the profile, the segment pass's previous setting profiled too (H200,
    # 2026-11-26: 133 s without the loader's ~30 s, the ptx step and the second profile). The limits add up
    # to 575 s, inside the device tool's 600 s a call (use a timeout_s of 600).
    [ -f gpu-in/gpu_suite.json ] && cp gpu-in/gpu_suite.json "$suite"
    step 90 python3 benchmarks/gpu_suite.py --only tests --out "$suite"
    step 45 python3 benchmarks/gpu_suite.py --only ptx --out "$suite"  # access widths, registers, occupancy
    step 120 python3 benchmarks/gpu_suite.py --only embedding --out "$suite"  # 42 s on 2026-11-26
    step 75 python3 benchmarks/gpu_suite.py --only loader --out "$suite"  # with its stage times (LoaderStats)
    step 55 python3 benchmarks/tune_embedding.py --json "$OUT/tune_criteo_fp32.json"  # 30 settings: ~1 s each (H200)
    step 55 python3 benchmarks/tune_embedding.py --ids zipf --json "$OUT/tune_criteo_fp32_zipf.json"
    step 55 python3 benchmarks/tune_embedding.py --shape wide --json "$OUT/tune_wide_fp32.json"
    profile_passes 40
    # the segment pass as measured on 2026-11-26 (one run a program, a program per item, no long-item
    # path), for the side-by-side counters
    profile_segment_as_on_the_h200 40
elif [ "$part" = measure ]; then
    # check's core (tests, embedding, loader, one sweep, one profile): the limits add up to 335 s, so that a
    # second call (its own start, ~60-90 s) fits the session's 15 minutes after the defaults are set from it
    [ -f gpu-in/gpu_suite.json ] && cp gpu-in/gpu_suite.json "$suite"
    step 90 python3 benchmarks/gpu_suite.py --only tests --out "$suite"
    step 90 python3 benchmarks/gpu_suite.py --only embedding --out "$suite"
    step 60 python3 benchmarks/gpu_suite.py --only loader --out "$suite"
    step 55 python3 benchmarks/tune_embedding.py --json "$OUT/tune_criteo_fp32.json"
    profile_passes 40
elif [ "$part" = tune ]; then
    # after measure (its JSON carried in gpu-in/): the loader again (3 epochs a setting, the median), the
    # settings swept on the Criteo-like shape with uniform and Zipf ids, and the segment pass as measured on
    # the H200 (one run a program, a program per item, no long-item path) profiled beside measure's profile
    [ -f gpu-in/gpu_suite.json ] && cp gpu-in/gpu_suite.json "$suite"
    step 75 python3 benchmarks/gpu_suite.py --only loader --out "$suite"
    step 60 python3 benchmarks/tune_embedding.py --json "$OUT/tune_criteo_fp32.json"
    step 60 python3 benchmarks/tune_embedding.py --ids zipf --json "$OUT/tune_criteo_fp32_zipf.json"
    profile_segment_as_on_the_h200 40
elif [ "$part" = segment ]; then
    # the segment pass's settings alone, on the Criteo-like shape (uniform, Zipf), the long bags and the wide
    # shape: a rule for the defaults must hold on all of them, not only where it was found
    step 50 python3 benchmarks/tune_embedding.py --only segment: --json "$OUT/tune_segment_criteo.json"
    step 50 python3 benchmarks/tune_embedding.py --only segment: --ids zipf --json "$OUT/tune_segment_criteo_zipf.json"
    step 35 python3 benchmarks/tune_embedding.py --only segment: --shape long128 --ids zipf \
        --json "$OUT/tune_segment_long128_zipf.json"
    step 35 python3 benchmarks/tune_embedding.py --only segment: --shape long64 --json "$OUT/tune_segment_long64.json"
    step 40 python3 benchmarks/tune_embedding.py --only segment: --shape wide --json "$OUT/tune_segment_wide.json"
elif [ "$part" = final ]; then
    # after the defaults changed (the JSON so far carried in gpu-in/): every step the change touches
    [ -f gpu-in/gpu_suite.json ] && cp gpu-in/gpu_suite.json "$suite"
    step 75 python3 benchmarks/gpu_suite.py --only tests --out "$suite"
    step 30 python3 benchmarks/gpu_suite.py --only ptx --out "$suite"
    step 90 python3 benchmarks/gpu_suite.py --only embedding --out "$suite"
    step 100 python3 benchmarks/gpu_suite.py --only train --out "$suite"
    profile_passes 30
elif [ "$part" = dynamic ]; then
    # issue 42, not yet run on a GPU: the dynamic tables' and the host tier's gpu tests (the map and the
    # kernels on CUDA against the CPU reference; a pinned store with side-stream prefetch against the whole
    # table), then lookup + update throughput, dynamic and host tier vs static on the same batches, at the
    # seeds' shape (one 10M-row table, dim 64, batch 16K) and a Criteo-like one (8 tables x 2M x 128, batch
    # 64K). Limits add up to 315 s (guesses: no GPU has run these; the CPU run of the small shape took ~60 s).
    dynamic_steps 75 120
elif [ "$part" = fbgemm ]; then
    # issue 39: FBGEMM's TBE side by side with recloop on every embedding shape (fp32, bf16; uniform, Zipf),
    # the uncapped Criteo shape among them. Carry .whl-fbgemm (benchmarks/fbgemm_wheel.py prepare: the
    # released fbgemm_gpu 1.6.0, sm_90 code only, ~56 MiB). The GPU tests first (their fp32 tolerance now
    # follows the summation length). Limits add up to 360 s.
    step 60 python3 benchmarks/fbgemm_wheel.py install --target /tmp/site
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    step 90 python3 benchmarks/gpu_suite.py --only tests --out "$suite"
    step 210 python3 benchmarks/gpu_suite.py --only embedding --out "$suite"
elif [ "$part" = fbgemm-dynamic ]; then
    # one call for both (issues 39 and 42) after fixes: the embedding step with FBGEMM (bf16 now configured),
    # then the dynamic part's steps. Carry .whl-fbgemm. Limits add up to 485 s.
    step 60 python3 benchmarks/fbgemm_wheel.py install --target /tmp/site
    step 150 env PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/gpu_suite.py --only embedding \
        --out "$suite"
    dynamic_steps 75 100  # took 23, 24 and 36 s on the H200 (2026-11-28)
elif [ "$part" = fbgemm-half ]; then
    # the two-byte weights against FBGEMM: recloop bf16 beside FBGEMM fp16 (its release has no bf16 training
    # kernel), and fp16 against fp16. Carry .whl-fbgemm. Limits add up to 210 s.
    step 60 python3 benchmarks/fbgemm_wheel.py install --target /tmp/site
    step 150 env PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} RECLOOP_EMBEDDING_DTYPES=bfloat16,float16 \
        python3 benchmarks/gpu_suite.py --only embedding --out "$suite"
elif [ "$part" = 1 ]; then
    step 120 python3 benchmarks/gpu_suite.py --only tests --out "$suite"
    step 30 python3 benchmarks/gpu_suite.py --only ptx --quick --out "$suite"
    step 150 python3 benchmarks/gpu_suite.py --only embedding --quick --out "$suite"
    step 75 python3 benchmarks/gpu_suite.py --only loader --out "$suite"
else
    [ -f gpu-in/gpu_suite.json ] && cp gpu-in/gpu_suite.json "$suite"  # part 1's JSON, carried back in
    step 180 python3 benchmarks/gpu_suite.py --only train --out "$suite"
    step 100 python3 benchmarks/tune_embedding.py --json "$OUT/tune_criteo_fp32.json"
    # the second pass only (the first compiles): forward, linearize, segment, split
    profile_passes 50
fi
