export PYTHONPATH=$PWD/.peers/flashmla-sm90-sparse:$PYTHONPATH
R="2,1,128 2,2,128 32,1,128 32,2,128 128,1,128 128,2,128 2,1,64 2,2,64 32,1,64 32,2,64 128,1,64 128,2,64"
timeout 55 python -m torch_mla.precompile --arch sm_90a --kernels sparse_split,schedule --dtypes bf16 --jobs 16 > $OUT/pre.log 2>&1; tail -2 $OUT/pre.log
timeout 40 python -m tools.sparse_rows split 656 $R 2>&1 | grep " us"
timeout 30 python -m tools.sparse_rows flashmla 656 $R 2>&1 | grep " us"
timeout 35 python -m tools.flashmla_sparse_tests .peers/flashmla-tests --every 3 > $OUT/compat.log 2>&1; echo "compat rc=$?"; tail -3 $OUT/compat.log
