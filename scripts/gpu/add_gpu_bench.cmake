# Passed as -DCMAKE_PROJECT_INCLUDE=... by scripts/gpu/test_and_bench.sh: defines bench/gpu's
# target at the end of the top-level configure unless bench/CMakeLists.txt already added it.
function(_quads_add_gpu_bench)
  if(TARGET quads_cuda AND NOT TARGET bench_cuda)
    include(${CMAKE_SOURCE_DIR}/bench/gpu/CMakeLists.txt)
  endif()
endfunction()
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL _quads_add_gpu_bench)
