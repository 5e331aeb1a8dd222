module @jit_fp8_linear attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<2x3xbf16>, %arg1: tensor<4x3xui8>, %arg2: tensor<1x1xf32>) -> (tensor<2x4xf32> {jax.result_info = "result"}) {
    %0 = stablehlo.bitcast_convert %arg1 : (tensor<4x3xui8>) -> tensor<4x3xf8E4M3FN>
    %1 = stablehlo.convert %arg0 : (tensor<2x3xbf16>) -> tensor<2x3xf8E4M3FN>
    %2 = stablehlo.dot_general %1, %0, contracting_dims = [1] x [1], precision = [DEFAULT, DEFAULT] : (tensor<2x3xf8E4M3FN>, tensor<4x3xf8E4M3FN>) -> tensor<2x4xf32>
    %3 = stablehlo.reshape %arg2 : (tensor<1x1xf32>) -> tensor<f32>
    %4 = stablehlo.broadcast_in_dim %3, dims = [] : (tensor<f32>) -> tensor<2x4xf32>
    %5 = stablehlo.multiply %2, %4 : tensor<2x4xf32>
    return %5 : tensor<2x4xf32>
  }
}
