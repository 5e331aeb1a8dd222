module attributes {stable_mosaic.version = 11 : i64} {
  func.func @fp8_linear_v2_kernel(%arg0: i32, %arg1: i32, %arg2: memref<256x512xbf16, #tpu.memory_space<any>>, %arg3: memref<256x512xf8E4M3FN, #tpu.memory_space<any>>, %arg4: memref<2x4xf32, #tpu.memory_space<vmem>>, %arg5: memref<128x128xbf16, #tpu.memory_space<vmem>>, %arg6: memref<2x128x128xbf16, #tpu.memory_space<vmem>>, %arg7: memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>>, %arg8: memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>, %arg9: memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>, %arg10: memref<128x128xf32, #tpu.memory_space<vmem>>) attributes {dimension_semantics = [#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<parallel>], iteration_bounds = array<i64: 2, 2>, scalar_prefetch = 0 : i64, scratch_operands = 5 : i64, tpu.core_type = #tpu.core_type<tc>, window_params = [{}, {}, {transform_indices = @transform_2, window_bounds = array<i64: 2, 4>}, {transform_indices = @transform_3, window_bounds = array<i64: 128, 128>}]} {
    %c128_i32 = arith.constant 128 : i32
    %0 = arith.muli %arg0, %c128_i32 : i32
    %1 = arith.muli %arg1, %c128_i32 : i32
    %c0_i32 = arith.constant 0 : i32
    %c1_i32 = arith.constant 1 : i32
    %c2_i32 = arith.constant 2 : i32
    %c4_i32 = arith.constant 4 : i32
    %c0 = arith.constant 0 : index
    %2 = tpu.memref_slice %arg2[%0, %c0_i32] : memref<256x512xbf16, #tpu.memory_space<any>> -> memref<128x128xbf16, #tpu.memory_space<any>>
    %3 = tpu.memref_slice %arg6[%c0_i32, %c0_i32, %c0_i32] : memref<2x128x128xbf16, #tpu.memory_space<vmem>> -> memref<1x128x128xbf16, #tpu.memory_space<vmem>>
    %4 = tpu.memref_squeeze %3 : memref<1x128x128xbf16, #tpu.memory_space<vmem>> -> memref<128x128xbf16, #tpu.memory_space<vmem>>
    %5 = tpu.memref_slice %arg8[%c0_i32] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    %6 = tpu.memref_squeeze %5 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    tpu.enqueue_dma source(%2 : memref<128x128xbf16, #tpu.memory_space<any>>) target(%4 : memref<128x128xbf16, #tpu.memory_space<vmem>>) target_semaphore(%6 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
    %7 = tpu.memref_slice %arg3[%1, %c0_i32] : memref<256x512xf8E4M3FN, #tpu.memory_space<any>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<any>>
    %8 = tpu.memref_slice %arg7[%c0_i32, %c0_i32, %c0_i32] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>>
    %9 = tpu.memref_squeeze %8 : memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>
    %10 = tpu.memref_slice %arg9[%c0_i32] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    %11 = tpu.memref_squeeze %10 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    tpu.enqueue_dma source(%7 : memref<128x128xf8E4M3FN, #tpu.memory_space<any>>) target(%9 : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>) target_semaphore(%11 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
    %cst = arith.constant 0.000000e+00 : f32
    %12 = vector.broadcast %cst : f32 to vector<128x128xf32>
    tpu.vector_store %arg10[%c0, %c0], %12 {strides = array<i32>} : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>,
    scf.for %arg11 = %c0_i32 to %c4_i32 step %c1_i32  : i32 {
      %13 = arith.remsi %arg11, %c2_i32 : i32
      %14 = arith.addi %arg11, %c1_i32 : i32
      %15 = arith.cmpi slt, %14, %c4_i32 : i32
      scf.if %15 {
        %16 = arith.remsi %14, %c2_i32 : i32
        %17 = arith.muli %14, %c128_i32 : i32
        %18 = tpu.memref_slice %arg2[%0, %17] : memref<256x512xbf16, #tpu.memory_space<any>> -> memref<128x128xbf16, #tpu.memory_space<any>>
        %19 = tpu.memref_slice %arg6[%16, %c0_i32, %c0_i32] : memref<2x128x128xbf16, #tpu.memory_space<vmem>> -> memref<1x128x128xbf16, #tpu.memory_space<vmem>>
        %20 = tpu.memref_squeeze %19 : memref<1x128x128xbf16, #tpu.memory_space<vmem>> -> memref<128x128xbf16, #tpu.memory_space<vmem>>
        %21 = tpu.memref_slice %arg8[%16] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        %22 = tpu.memref_squeeze %21 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        tpu.enqueue_dma source(%18 : memref<128x128xbf16, #tpu.memory_space<any>>) target(%20 : memref<128x128xbf16, #tpu.memory_space<vmem>>) target_semaphore(%22 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
        %23 = tpu.memref_slice %arg3[%1, %17] : memref<256x512xf8E4M3FN, #tpu.memory_space<any>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<any>>
        %24 = tpu.memref_slice %arg7[%16, %c0_i32, %c0_i32] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>>
        %25 = tpu.memref_squeeze %24 : memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>
        %26 = tpu.memref_slice %arg9[%16] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        %27 = tpu.memref_squeeze %26 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        tpu.enqueue_dma source(%23 : memref<128x128xf8E4M3FN, #tpu.memory_space<any>>) target(%25 : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>) target_semaphore(%27 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
      } else {
      }
      %28 = arith.muli %arg11, %c128_i32 : i32
      %29 = tpu.memref_slice %arg2[%0, %28] : memref<256x512xbf16, #tpu.memory_space<any>> -> memref<128x128xbf16, #tpu.memory_space<any>>
      %30 = tpu.memref_slice %arg6[%13, %c0_i32, %c0_i32] : memref<2x128x128xbf16, #tpu.memory_space<vmem>> -> memref<1x128x128xbf16, #tpu.memory_space<vmem>>
      %31 = tpu.memref_squeeze %30 : memref<1x128x128xbf16, #tpu.memory_space<vmem>> -> memref<128x128xbf16, #tpu.memory_space<vmem>>
      %32 = tpu.memref_slice %arg8[%13] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      %33 = tpu.memref_squeeze %32 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      tpu.wait_dma2 semaphore(%33 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>) src(%29 : memref<128x128xbf16, #tpu.memory_space<any>>) dst(%31 : memref<128x128xbf16, #tpu.memory_space<vmem>>)
      %34 = tpu.memref_slice %arg3[%1, %28] : memref<256x512xf8E4M3FN, #tpu.memory_space<any>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<any>>
      %35 = tpu.memref_slice %arg7[%13, %c0_i32, %c0_i32] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>>
      %36 = tpu.memref_squeeze %35 : memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>
      %37 = tpu.memref_slice %arg9[%13] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      %38 = tpu.memref_squeeze %37 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      tpu.wait_dma2 semaphore(%38 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>) src(%34 : memref<128x128xf8E4M3FN, #tpu.memory_space<any>>) dst(%36 : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>)
      %39 = arith.index_cast %13 : i32 to index
      %40 = vector.load %arg6[%39, %c0, %c0] : memref<2x128x128xbf16, #tpu.memory_space<vmem>>, vector<1x128x128xbf16>
      %41 = vector.shape_cast %40 : vector<1x128x128xbf16> to vector<128x128xbf16>
      %42 = vector.load %arg7[%39, %c0, %c0] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>>, vector<1x128x128xf8E4M3FN>
      %43 = vector.shape_cast %42 : vector<1x128x128xf8E4M3FN> to vector<128x128xf8E4M3FN>
      %44 = arith.extf %43 : vector<128x128xf8E4M3FN> to vector<128x128xbf16>
      %cst_0 = arith.constant dense<0.000000e+00> : vector<128x128xf32>
      %45 = tpu.matmul %41, %44, %cst_0 {dimension_numbers = #tpu.dot_dimension_numbers<[1], [1], [0], [0], [0, 0, 1, 0], [], []>} : vector<128x128xbf16>, vector<128x128xbf16>, vector<128x128xf32> -> vector<128x128xf32>
      %46 = arith.index_cast %arg1 : i32 to index
      %47 = arith.index_cast %arg11 : i32 to index
      %48 = vector.load %arg4[%46, %47] : memref<2x4xf32, #tpu.memory_space<vmem>>, vector<1x1xf32>
      %49 = vector.broadcast %48 : vector<1x1xf32> to vector<128x128xf32>
      %50 = arith.mulf %45, %49 : vector<128x128xf32>
      %51 = vector.load %arg10[%c0, %c0] : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>
      %52 = arith.addf %51, %50 : vector<128x128xf32>
      tpu.vector_store %arg10[%c0, %c0], %52 {strides = array<i32>} : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>,
    }
    %53 = vector.load %arg10[%c0, %c0] : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>
    %54 = arith.truncf %53 : vector<128x128xf32> to vector<128x128xbf16>
    tpu.vector_store %arg5[%c0, %c0], %54 {strides = array<i32>} : memref<128x128xbf16, #tpu.memory_space<vmem>>, vector<128x128xbf16>,
    return
  }
  func.func @transform_2(%arg0: i32, %arg1: i32) -> (i32, i32) {
    %c0_i32 = arith.constant 0 : i32
    return %c0_i32, %c0_i32 : i32, i32
  }
  func.func @transform_3(%arg0: i32, %arg1: i32) -> (i32, i32) {
    return %arg0, %arg1 : i32, i32
  }
}
