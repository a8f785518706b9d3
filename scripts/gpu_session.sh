#!/usr/bin/env bash
# One call on the lent GPU machine (issue 25): its facts, the GPU tests, then chapter recordings
# in the order given, each under what is left of the budget, until the deadline. Every step runs
# even when one before it failed; what was recorded is packed into $OUT after each step, so a
# call cut off at its limit still brings back what it finished.
#
#   bash scripts/gpu_session.sh BUDGET_S STEP...
#   STEP: env, tests, device, compiled (chapter 11's stage: scripts/gpu_compiled.py), NN (a chapter)
#
# A session has 15 minutes of device time, a machine's start 1-2 of them. Recorded so far:
# chapters 01-03 (not 03's context sweep) and 05-10 on an H200 or an H100. The next session, a
# first call (timeout_s 600)
#   bash scripts/gpu_session.sh 545 env tests compiled 04     (tests ~80 s; compiled capped at
#                                                               300 s, its Qwen compile unmeasured)
# then, on the warm machine at once, what is left of `04` or `03` (its sweep, ~3.3 minutes).
#
# The machine has its own python3 with torch and triton; what the book needs beyond them travels
# as wheels in .whl/ and SmolLM2's tokenizer (which the random-weight Qwen uses) in .gpu_cache/,
# both made here by scripts/gpu_carry.sh.
set -u
budget=$1; shift
deadline=$(( $(date +%s) + budget ))
out=${OUT:-/tmp/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MINIINFER_CACHE=$PWD/.gpu_cache
# A session records the book's GPU tables (data/results/), not a reader's (data/yours/); the
# tree it runs in is a copy of a clean commit (the session's caller checks that, not git here).
export MINIINFER_RECORD_FOR_BOOK=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || echo "wheels did not install"
    export PYTHONPATH=$PWD:/tmp/site
else
    export PYTHONPATH=$PWD
fi
touch /tmp/session-start
left() { echo $(( deadline - $(date +%s) )); }
pack() {  # every results file this call wrote or changed
    find data/results -type f -newer /tmp/session-start > /tmp/changed
    tar czf "$out/results.tgz" -T /tmp/changed 2>/dev/null
}
summary=""
for step in "$@"; do
    t=$(left)
    if [ "$t" -lt 30 ]; then summary+="$step: not run (budget spent)"$'\n'; continue; fi
    start=$(date +%s)
    case $step in
    env)
        { nvidia-smi; nvidia-smi -q | grep -iE "clocks|power draw|persistence" | head -20
          python3 -c "import torch, triton, transformers; print('torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers',
transformers.__version__); p = torch.cuda.get_device_properties(0); print(p)"
          python3 -c "import flash_attn" 2>&1 | tail -1
          # The server (chapter 10) and DuckDB come from the carried wheels: a missing one shows
          # here, not minutes later in the chapter that needs it.
          python3 -c "import miniinfer.server, duckdb; print('server and duckdb import')" 2>&1 \
              | tail -1
          nproc; free -g; } > "$out/env.txt" 2>&1
        rc=$?; tail -4 "$out/env.txt" ;;
    tests)
        # 52 s on the H200 before test_gpu_equality.py (every stage vs hf) was added.
        timeout $(( t < 240 ? t : 240 )) python3 -m pytest -q -p no:cacheprovider -m "not slow" \
            -k "not in_subprocess" tests/test_kernels.py tests/test_gpu_equality.py \
            tests/test_ch07_async.py::test_every_loop_matches_paged_attention_on_gpu \
            tests/test_ch07_async.py::test_graph_replay_equals_eager_in_bf16 --durations=10 \
            > "$out/tests.txt" 2>&1
        rc=$?; tail -25 "$out/tests.txt" ;;
    device)
        timeout "$t" python3 -m miniinfer device --device cuda --measure >> "$out/run.log" 2>&1
        rc=$? ;;
    compiled)  # chapter 11's stage on the GPU: tokens vs hf (tiny, Qwen bf16), compile time, speed
        timeout "$(( t < 300 ? t : 300 ))" python3 scripts/gpu_compiled.py "$out" \
            >> "$out/compiled.txt" 2>&1
        rc=$?; grep -vi warn "$out/compiled.txt" | tail -20 ;;
    *)
        echo "== chapter $step ($t s left) ==" >> "$out/run.log"
        # SIGINT, as Ctrl-C: a benchmark cut off writes its finished rows, marked partial.
        timeout -s INT -k 20 "$t" python3 -m miniinfer repro "$step" --device cuda --no-notebook \
            >> "$out/run.log" 2>&1
        rc=$? ;;
    esac
    summary+="$step: rc $rc in $(( $(date +%s) - start )) s"$'\n'
    pack
done
echo "== run.log (end) =="; tail -60 "$out/run.log" 2>/dev/null
echo "== files =="; cat /tmp/changed
echo "== steps =="; printf '%s' "$summary"
