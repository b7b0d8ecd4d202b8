set -x
source .devpkgs/b/setup.sh
export PYTHONPATH=$PWD/.peers/flashmla-sm90-sparse:$PYTHONPATH
python -m torch_mla.precompile --arch sm_90a --kernels sparse,portable,schedule,append_kv --jobs 8 > $OUT/precompile.log 2>&1; tail -3 $OUT/precompile.log
timeout 400 python -m pytest -m cuda -x -q tests/test_sparse_kernel.py tests/test_sparse.py > $OUT/tests.log 2>&1; tail -15 $OUT/tests.log
timeout 200 python benchmarks/bench_decode.py --sparse > $OUT/bench_sparse.log 2>&1; cat $OUT/bench_sparse.log | tail -30
