module attributes {stable_mosaic.version = 11 : i64} {
  func.func @fp8_linear_v3_kernel(%arg0: i32, %arg1: i32, %arg2: memref<256x512xbf16, #tpu.memory_space<any>>, %arg3: memref<256x512xf8E4M3FN, #tpu.memory_space<any>>, %arg4: memref<2x4xf32, #tpu.memory_space<any>>, %arg5: memref<128x128xbf16, #tpu.memory_space<vmem>>, %arg6: memref<2x128x128xbf16, #tpu.memory_space<vmem>>, %arg7: memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>>, %arg8: memref<2x1x1xf32, #tpu.memory_space<smem>>, %arg9: memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>, %arg10: memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>, %arg11: memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>, %arg12: memref<128x128xf32, #tpu.memory_space<vmem>>) attributes {dimension_semantics = [#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<parallel>], iteration_bounds = array<i64: 2, 2>, scalar_prefetch = 0 : i64, scratch_operands = 7 : i64, tpu.core_type = #tpu.core_type<tc>, window_params = [{}, {}, {}, {transform_indices = @transform_3, window_bounds = array<i64: 128, 128>}]} {
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
    %5 = tpu.memref_slice %arg9[%c0_i32] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    %6 = tpu.memref_squeeze %5 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    tpu.enqueue_dma source(%2 : memref<128x128xbf16, #tpu.memory_space<any>>) target(%4 : memref<128x128xbf16, #tpu.memory_space<vmem>>) target_semaphore(%6 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
    %7 = tpu.memref_slice %arg3[%1, %c0_i32] : memref<256x512xf8E4M3FN, #tpu.memory_space<any>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<any>>
    %8 = tpu.memref_slice %arg7[%c0_i32, %c0_i32, %c0_i32] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>>
    %9 = tpu.memref_squeeze %8 : memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>
    %10 = tpu.memref_slice %arg10[%c0_i32] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    %11 = tpu.memref_squeeze %10 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    tpu.enqueue_dma source(%7 : memref<128x128xf8E4M3FN, #tpu.memory_space<any>>) target(%9 : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>) target_semaphore(%11 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
    %12 = tpu.memref_slice %arg4[%arg1, %c0_i32] : memref<2x4xf32, #tpu.memory_space<any>> -> memref<1x1xf32, #tpu.memory_space<any>>
    %13 = tpu.memref_slice %arg8[%c0_i32, %c0_i32, %c0_i32] : memref<2x1x1xf32, #tpu.memory_space<smem>> -> memref<1x1x1xf32, #tpu.memory_space<smem>>
    %14 = tpu.memref_squeeze %13 : memref<1x1x1xf32, #tpu.memory_space<smem>> -> memref<1x1xf32, #tpu.memory_space<smem>>
    %15 = tpu.memref_slice %arg11[%c0_i32] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    %16 = tpu.memref_squeeze %15 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
    tpu.enqueue_dma source(%12 : memref<1x1xf32, #tpu.memory_space<any>>) target(%14 : memref<1x1xf32, #tpu.memory_space<smem>>) target_semaphore(%16 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
    %cst = arith.constant 0.000000e+00 : f32
    %17 = vector.broadcast %cst : f32 to vector<128x128xf32>
    tpu.vector_store %arg12[%c0, %c0], %17 {strides = array<i32>} : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>,
    scf.for %arg13 = %c0_i32 to %c4_i32 step %c1_i32  : i32 {
      %18 = arith.remsi %arg13, %c2_i32 : i32
      %19 = arith.addi %arg13, %c1_i32 : i32
      %20 = arith.cmpi slt, %19, %c4_i32 : i32
      scf.if %20 {
        %21 = arith.remsi %19, %c2_i32 : i32
        %22 = arith.muli %19, %c128_i32 : i32
        %23 = tpu.memref_slice %arg2[%0, %22] : memref<256x512xbf16, #tpu.memory_space<any>> -> memref<128x128xbf16, #tpu.memory_space<any>>
        %24 = tpu.memref_slice %arg6[%21, %c0_i32, %c0_i32] : memref<2x128x128xbf16, #tpu.memory_space<vmem>> -> memref<1x128x128xbf16, #tpu.memory_space<vmem>>
        %25 = tpu.memref_squeeze %24 : memref<1x128x128xbf16, #tpu.memory_space<vmem>> -> memref<128x128xbf16, #tpu.memory_space<vmem>>
        %26 = tpu.memref_slice %arg9[%21] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        %27 = tpu.memref_squeeze %26 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        tpu.enqueue_dma source(%23 : memref<128x128xbf16, #tpu.memory_space<any>>) target(%25 : memref<128x128xbf16, #tpu.memory_space<vmem>>) target_semaphore(%27 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
        %28 = tpu.memref_slice %arg3[%1, %22] : memref<256x512xf8E4M3FN, #tpu.memory_space<any>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<any>>
        %29 = tpu.memref_slice %arg7[%21, %c0_i32, %c0_i32] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>>
        %30 = tpu.memref_squeeze %29 : memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>
        %31 = tpu.memref_slice %arg10[%21] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        %32 = tpu.memref_squeeze %31 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        tpu.enqueue_dma source(%28 : memref<128x128xf8E4M3FN, #tpu.memory_space<any>>) target(%30 : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>) target_semaphore(%32 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
        %33 = tpu.memref_slice %arg4[%arg1, %19] : memref<2x4xf32, #tpu.memory_space<any>> -> memref<1x1xf32, #tpu.memory_space<any>>
        %34 = tpu.memref_slice %arg8[%21, %c0_i32, %c0_i32] : memref<2x1x1xf32, #tpu.memory_space<smem>> -> memref<1x1x1xf32, #tpu.memory_space<smem>>
        %35 = tpu.memref_squeeze %34 : memref<1x1x1xf32, #tpu.memory_space<smem>> -> memref<1x1xf32, #tpu.memory_space<smem>>
        %36 = tpu.memref_slice %arg11[%21] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        %37 = tpu.memref_squeeze %36 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
        tpu.enqueue_dma source(%33 : memref<1x1xf32, #tpu.memory_space<any>>) target(%35 : memref<1x1xf32, #tpu.memory_space<smem>>) target_semaphore(%37 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>)
      } else {
      }
      %38 = arith.muli %arg13, %c128_i32 : i32
      %39 = tpu.memref_slice %arg2[%0, %38] : memref<256x512xbf16, #tpu.memory_space<any>> -> memref<128x128xbf16, #tpu.memory_space<any>>
      %40 = tpu.memref_slice %arg6[%18, %c0_i32, %c0_i32] : memref<2x128x128xbf16, #tpu.memory_space<vmem>> -> memref<1x128x128xbf16, #tpu.memory_space<vmem>>
      %41 = tpu.memref_squeeze %40 : memref<1x128x128xbf16, #tpu.memory_space<vmem>> -> memref<128x128xbf16, #tpu.memory_space<vmem>>
      %42 = tpu.memref_slice %arg9[%18] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      %43 = tpu.memref_squeeze %42 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      tpu.wait_dma2 semaphore(%43 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>) src(%39 : memref<128x128xbf16, #tpu.memory_space<any>>) dst(%41 : memref<128x128xbf16, #tpu.memory_space<vmem>>)
      %44 = tpu.memref_slice %arg3[%1, %38] : memref<256x512xf8E4M3FN, #tpu.memory_space<any>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<any>>
      %45 = tpu.memref_slice %arg7[%18, %c0_i32, %c0_i32] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>>
      %46 = tpu.memref_squeeze %45 : memref<1x128x128xf8E4M3FN, #tpu.memory_space<vmem>> -> memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>
      %47 = tpu.memref_slice %arg10[%18] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      %48 = tpu.memref_squeeze %47 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      tpu.wait_dma2 semaphore(%48 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>) src(%44 : memref<128x128xf8E4M3FN, #tpu.memory_space<any>>) dst(%46 : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>)
      %49 = tpu.memref_slice %arg4[%arg1, %arg13] : memref<2x4xf32, #tpu.memory_space<any>> -> memref<1x1xf32, #tpu.memory_space<any>>
      %50 = tpu.memref_slice %arg8[%18, %c0_i32, %c0_i32] : memref<2x1x1xf32, #tpu.memory_space<smem>> -> memref<1x1x1xf32, #tpu.memory_space<smem>>
      %51 = tpu.memref_squeeze %50 : memref<1x1x1xf32, #tpu.memory_space<smem>> -> memref<1x1xf32, #tpu.memory_space<smem>>
      %52 = tpu.memref_slice %arg11[%18] : memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      %53 = tpu.memref_squeeze %52 : memref<1x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>> -> memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>
      tpu.wait_dma2 semaphore(%53 : memref<!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>) src(%49 : memref<1x1xf32, #tpu.memory_space<any>>) dst(%51 : memref<1x1xf32, #tpu.memory_space<smem>>)
      %54 = arith.index_cast %18 : i32 to index
      %55 = vector.load %arg6[%54, %c0, %c0] : memref<2x128x128xbf16, #tpu.memory_space<vmem>>, vector<1x128x128xbf16>
      %56 = vector.shape_cast %55 : vector<1x128x128xbf16> to vector<128x128xbf16>
      %57 = vector.load %arg7[%54, %c0, %c0] : memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>>, vector<1x128x128xf8E4M3FN>
      %58 = vector.shape_cast %57 : vector<1x128x128xf8E4M3FN> to vector<128x128xf8E4M3FN>
      %59 = arith.extf %58 : vector<128x128xf8E4M3FN> to vector<128x128xbf16>
      %cst_0 = arith.constant dense<0.000000e+00> : vector<128x128xf32>
      %60 = tpu.matmul %56, %59, %cst_0 {dimension_numbers = #tpu.dot_dimension_numbers<[1], [1], [0], [0], [0, 0, 1, 0], [], []>} : vector<128x128xbf16>, vector<128x128xbf16>, vector<128x128xf32> -> vector<128x128xf32>
      %61 = memref.load %arg8[%54, %c0, %c0] : memref<2x1x1xf32, #tpu.memory_space<smem>>
      %62 = vector.broadcast %61 : f32 to vector<128x128xf32>
      %63 = arith.mulf %60, %62 : vector<128x128xf32>
      %64 = vector.load %arg12[%c0, %c0] : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>
      %65 = arith.addf %64, %63 : vector<128x128xf32>
      tpu.vector_store %arg12[%c0, %c0], %65 {strides = array<i32>} : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>,
    }
    %66 = vector.load %arg12[%c0, %c0] : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>
    %67 = arith.truncf %66 : vector<128x128xf32> to vector<128x128xbf16>
    tpu.vector_store %arg5[%c0, %c0], %67 {strides = array<i32>} : memref<128x128xbf16, #tpu.memory_space<vmem>>, vector<128x128xbf16>,
    return
  }
  func.func @transform_3(%arg0: i32, %arg1: i32) -> (i32, i32) {
    return %arg0, %arg1 : i32, i32
  }
}
