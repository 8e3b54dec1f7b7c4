//! Gradient check of every autodiff rule (issue 13, item 4): per rule case, a small forward
//! model whose differentiable inputs are seeded random initializers, the loss
//! `loss = ReduceSum(Mul(Y, R))` with a fixed random `R` (so dL/dY = R), differentiated by
//! `autodiff(loss=loss,freeze=k_*),legalize-ort` (the `k_` initializers are constants: R,
//! Clip bounds, Pad values, ...), run on ONNX Runtime, against central finite differences
//! of that same gradient graph's `loss` output: per parameter
//! `||g - fd|| / max(||fd||, tiny)`, and the case's error is the largest over its parameters.
//!
//! float64 cases: h = 1e-6, tolerance 1e-6. float32 cases: h = 1e-3 (the difference is
//! divided by the perturbation as actually rounded to float32), tolerance 1e-3.
//!
//! float32 fallbacks, measured on ONNX Runtime 1.31.1's CPU provider (the float64 session
//! fails with "Could not find an implementation for <op>"):
//! - the forward op has no float64 kernel: Conv, ConvTranspose, InstanceNormalization,
//!   AveragePool, GlobalAveragePool, Erf, Gelu (opset 20, approximate=none: its function
//!   body's Erf), Elu, HardSigmoid, HardSwish (its function body's HardSigmoid), Softplus,
//!   Mean, Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh, Softsign, Selu, Celu,
//!   ThresholdedRelu, Shrink, Mish, PRelu, GlobalMaxPool, Resize, MeanVarianceNormalization
//!   (its function body adds a float epsilon), LRN (4-D and odd sizes only), Hardmax (the
//!   recurrent layers: below);
//! - the backward uses an op without a float64 kernel: MaxPool with non-overlapping windows
//!   (the MaxPoolGrad lowering's MaxUnpool; overlapping MaxPool runs in float64).
//!   (SoftmaxCrossEntropyLoss was one while its gradient's lowering built a OneHot of
//!   float64 values; it gathers and scatters since, and runs in float64.)
//!
//! LeakyRelu, Gelu with approximate=tanh, MaxPool itself, GroupNormalization and everything
//! else run in float64. GroupNormalization at opset 21 computes its first stage in
//! `stash_type` (default 1, float32), so the float64 case sets stash_type = 11; a float32
//! case keeps the default; a float64 GroupNormalization with G = C checks the math the
//! InstanceNormalization rule shares (its own cases run in float32).
//!
//! No case is ignored. Multi-output nodes whose later outputs reach the loss:
//! split_only_later_output, layer_norm_only_mean, layer_norm_only_inv_std,
//! layer_norm_all_outputs_axis1, and the recurrent layers' Y, Y_h and Y_c. Tests expect a
//! clear error naming the node instead of a gradient (never a panic): a ConvTranspose with
//! `output_shape`, an einsum diagonal, Resize's tf_crop_and_resize, LSTM's sequence_lens,
//! a scatter whose reduction ONNX does not define, an Attention with a cache or whose
//! scores output is used, GridSample with reflection padding, a Dropout inside an If
//! branch (or two Ifs deep), a Scan axis beyond its input's rank. A Scan (rewritten as a Loop) runs its
//! forward on ONNX Runtime's own Scan kernel, so its axes and directions are checked
//! against ONNX Runtime's.
//!
//! Every case also runs its forward model on ONNX Runtime and compares that loss with the
//! gradient graph's (1e-12 relative in float64, 1e-5 in float32; Attention 1e-7, as
//! `attention_inputs` explains; a row with no key to attend is zero by ONNX 1.23, NaN by
//! ONNX Runtime 1.31's kernel, and that case is not compared), except where the autodiff
//! changes the forward on purpose (BatchNormalization on running statistics, Dropout to
//! their training forms):
//! what the normalisation rewrites (the recurrent layers, unrolled) must compute what ONNX
//! Runtime's own kernels compute. ONNX Runtime has no float64 LSTM, GRU or RNN, so each
//! recurrent case runs twice: in float32 against the kernels (its gradients, three cells of
//! small recurrent terms, measured to 1-2.3e-3 by float32 differences: tolerance 5e-3), and
//! in float64 with the outputs' dims given, for the gradients (1e-6).
//!
//! Measured relative errors (largest over a case's parameters; `cargo test --test suite
//! autodiff_rules:: -- --nocapture --test-threads 1` prints them per parameter as
//! `MEASURED` lines):
//!
//! case                                       type error
//! abs                                        f64  1.2e-10
//! acos                                       f32  2.0e-4
//! acosh                                      f32  1.9e-4
//! add                                        f64  7.8e-11
//! add_broadcast_decided_at_run_time          f64  3.5e-11
//! add_broadcast_nc_c                         f64  4.5e-11
//! add_not_broadcast_decided_at_run_time      f64  5.2e-11
//! asin                                       f32  4.9e-5
//! asinh                                      f32  5.0e-5
//! atan                                       f32  5.1e-5
//! atanh                                      f32  3.8e-5
//! attention_bool_mask_causal_softcap         f64  4.9e-8
//! attention_causal_4d                        f64  2.5e-8
//! attention_empty_row_is_zero                f64  4.8e-8
//! attention_f32_softmax_in_f64               f32  1.1e-3
//! attention_grouped_3d_float_mask_scale      f64  3.5e-8
//! average_pool                               f32  7.5e-5
//! average_pool_1d_ceil_exclude_pad           f32  4.9e-5
//! average_pool_ceil_mode                     f32  8.3e-5
//! average_pool_ceil_mode_padded              f32  1.6e-4
//! average_pool_exclude_pad                   f32  1.4e-4
//! average_pool_kernel_over_input             f32  5.3e-5
//! average_pool_overlapping_padded            f32  8.2e-5
//! batch_norm                                 f64  5.6e-10
//! batch_norm_computed_statistics             f64  6.3e-10
//! cast                                       f64  4.5e-11
//! cast_like                                  f64  1.1e-10
//! celu                                       f32  8.5e-5
//! clip                                       f64  1.3e-10
//! clip_crossed_bounds                        f64  1.6e-10
//! clip_learned_bounds                        f64  8.8e-11
//! clip_max_only                              f64  1.1e-10
//! concat                                     f64  1.2e-10
//! conv_channel_slices                        f32  2.0e-4
//! conv_dilation                              f32  1.1e-4
//! conv_group                                 f32  3.4e-4
//! conv_plain                                 f32  2.3e-4
//! conv_stride_pad                            f32  4.6e-4
//! conv_transpose_1d_group_bias               f32  1.6e-4
//! conv_transpose_1d_no_bias                  f32  1.0e-4
//! conv_transpose_group_dilation_no_bias      f32  1.9e-4
//! conv_transpose_plain                       f32  2.9e-4
//! conv_transpose_stride_pads_output_padding  f32  3.8e-4
//! cos                                        f64  2.3e-10
//! cosh                                       f32  1.7e-4
//! cum_sum                                    f64  1.1e-10
//! cum_sum_exclusive_reverse                  f64  2.8e-11
//! depth_to_space_crd                         f64  1.7e-10
//! depth_to_space_dcr                         f64  1.3e-10
//! div                                        f64  1.2e-10
//! div_broadcast                              f64  1.0e-10
//! dropout_on_tract_twin_f64                  f64  4.6e-10 (varies with what is drawn)
//! dropout_ratio_initializer_is_no_parameter_f64 f64  6.9e-11
//! einsum_attention_scores                    f64  2.5e-10
//! einsum_ellipsis                            f64  1.2e-10
//! einsum_ellipsis_broadcast_one              f64  1.2e-10
//! einsum_ellipsis_inside                     f64  7.2e-11
//! einsum_ellipsis_two_axes_one_side          f64  2.5e-10
//! einsum_implicit_output                     f64  1.2e-10
//! einsum_matmul                              f64  2.0e-10
//! einsum_outer                               f64  2.0e-10
//! einsum_sum_all                             f64  2.2e-10
//! einsum_summed_in_one_input                 f64  1.4e-10
//! einsum_three_operands                      f64  9.6e-11
//! einsum_transpose                           f64  2.2e-10
//! elu                                        f32  4.5e-5
//! erf                                        f32  1.7e-4
//! exp                                        f64  2.3e-10
//! expand                                     f64  2.8e-11
//! flatten                                    f64  1.5e-10
//! fmod                                       f64  4.8e-11
//! gather_axis0_2d                            f64  5.5e-11
//! gather_axis0_repeated                      f64  5.2e-11
//! gather_axis1_1d                            f64  3.7e-11
//! gather_axis1_2d_negative                   f64  2.5e-10
//! gather_axis1_scalar_index                  f64  8.5e-11
//! gather_elements                            f64  8.2e-11
//! gather_nd_batch_dims_1                     f32  2.3e-5
//! gather_nd_batch_dims_1_f64                 f64  5.3e-11
//! gather_nd_batch_dims_1_pairs_f64           f64  2.4e-11
//! gather_nd_batch_dims_2_f64                 f64  1.4e-10
//! gather_nd_elements                         f64  1.0e-11
//! gather_nd_slices                           f64  4.6e-11
//! gather_of_a_sliced_buffer_broadcast_over_the_batch f64  1.2e-10
//! gelu                                       f32  1.0e-4
//! gelu_tanh                                  f64  6.6e-9
//! gemm_nn                                    f64  2.1e-10
//! gemm_nt                                    f64  2.8e-10
//! gemm_tn                                    f64  2.0e-10
//! gemm_tt                                    f64  1.6e-10
//! global_average_pool                        f32  1.4e-4
//! global_max_pool                            f32  6.5e-5
//! grid_sample_bilinear_border_align_corners_opset16 f32  9.2e-5
//! grid_sample_linear_zeros                   f64  1.7e-10
//! grid_sample_linear_zeros_align_corners     f64  6.7e-11
//! grid_sample_nearest                        f64  1.7e-10
//! group_norm_opset18_one_group               f64  3.8e-10
//! group_norm_opset18_per_group               f64  3.9e-10
//! group_norm_opset21_f32_default_stash       f32  1.8e-4
//! group_norm_opset21_groups_equal_channels   f64  1.9e-10
//! group_norm_opset21_per_channel             f64  6.9e-10
//! gru_bidirectional                          f32  5.0e-4
//! gru_bidirectional_as_loop                  f32  1.3e-3
//! gru_bidirectional_as_loop_f64              f64  7.0e-10
//! gru_bidirectional_f64                      f64  1.6e-9
//! gru_linear_before_reset                    f32  1.2e-3
//! gru_linear_before_reset_f64                f64  1.2e-9
//! gru_linear_before_reset_zero_state         f32  1.2e-3
//! gru_linear_before_reset_zero_state_as_loop_f64 f64  1.7e-9
//! gru_linear_before_reset_zero_state_f64     f64  1.6e-9
//! gru_no_bias_initial_state                  f32  7.6e-4
//! gru_no_bias_initial_state_f64              f64  2.1e-9
//! hard_sigmoid                               f32  4.8e-5
//! hard_swish                                 f32  9.7e-5
//! hardmax_carries_no_gradient                f32  3.9e-5
//! identity                                   f64  4.9e-11
//! if_decided_by_shapes_f64                   f64  1.9e-10
//! if_holding_if                              f32  7.1e-5
//! if_holding_if_then_else_f64                f64  2.3e-10
//! if_holding_if_then_then_f64                f64  9.4e-11
//! if_holding_loop_f64                        f64  6.9e-11
//! if_holding_loop_kept_f64                   f64  4.2e-11
//! if_on_data_else_branch                     f32  2.9e-4
//! if_on_data_else_branch_f64                 f64  5.3e-10
//! if_on_data_then_branch                     f32  5.9e-5
//! if_on_data_then_branch_f64                 f64  2.1e-10
//! if_with_dropout_off_f64                    f64  4.2e-11
//! instance_norm_1d                           f32  3.6e-4
//! instance_norm_2d                           f32  1.9e-4
//! layer_norm_all_outputs_axis1               f32  2.1e-4
//! layer_norm_axis1                           f64  7.5e-8
//! layer_norm_last_axis                       f64  1.1e-7
//! layer_norm_only_inv_std                    f32  1.8e-4
//! layer_norm_only_mean                       f32  7.8e-5
//! leaky_relu                                 f64  9.3e-11
//! log                                        f64  2.5e-11
//! log_softmax_axis1                          f64  3.6e-10
//! log_softmax_last                           f64  4.8e-10
//! loop_in_loop_f64                           f64  4.7e-10
//! loop_in_loop_kept_f64                      f64  2.2e-10
//! loop_kept_scan_sliced                      f32  1.1e-4
//! loop_kept_scan_sliced_f64                  f64  2.3e-10
//! loop_kept_tf_while                         f32  7.0e-4
//! loop_kept_tf_while_f64                     f64  6.9e-10
//! loop_kept_trip_count                       f32  3.3e-4
//! loop_kept_trip_count_f64                   f64  6.1e-11
//! loop_kept_with_draws_twin_f64              f64  1.6e-9 (varies with what is drawn)
//! loop_tf_while                              f32  4.2e-4
//! loop_tf_while_f64                          f64  3.1e-10
//! loop_trip_count                            f32  1.4e-4
//! loop_trip_count_f64                        f64  1.9e-10
//! loop_with_ifs                              f32  9.1e-4
//! loop_with_ifs_f64                          f64  8.1e-10
//! loop_with_ifs_kept_f64                     f64  2.9e-9
//! lp_normalization_default_3d                f64  1.5e-10
//! lp_normalization_p1_axis0                  f64  1.5e-10
//! lp_normalization_p2_axis1                  f64  1.3e-10
//! lrn_defaults                               f32  1.4e-4
//! lrn_size3_bias2                            f32  3.8e-4
//! lrn_size5                                  f32  5.6e-4
//! lstm_bidirectional                         f32  5.1e-4
//! lstm_bidirectional_as_loop                 f32  8.0e-4
//! lstm_bidirectional_as_loop_f64             f64  2.8e-9
//! lstm_bidirectional_f64                     f64  2.3e-9
//! lstm_full                                  f32  1.5e-3
//! lstm_full_as_loop                          f32  8.3e-4
//! lstm_full_as_loop_f64                      f64  4.1e-9
//! lstm_full_f64                              f64  1.7e-9
//! lstm_plain                                 f32  2.3e-3
//! lstm_plain_as_loop_f64                     f64  2.0e-9
//! lstm_plain_f64                             f64  5.9e-9
//! lstm_reverse                               f32  1.0e-3
//! lstm_reverse_f64                           f64  1.8e-9
//! matmul_2d                                  f64  3.2e-10
//! matmul_batched                             f64  1.9e-10
//! matmul_broadcast_batch                     f64  1.5e-10
//! matmul_btk_kn                              f64  2.0e-10
//! max                                        f64  1.7e-10
//! max_broadcast                              f64  6.1e-11
//! max_pool_disjoint                          f32  9.7e-5
//! max_pool_overlapping                       f64  3.7e-10
//! mean_broadcast                             f32  1.3e-4
//! mean_variance_norm_default_axes            f32  1.2e-4
//! mean_variance_norm_last_axis               f32  1.4e-4
//! min_broadcast                              f64  1.1e-10
//! mish                                       f32  6.1e-5
//! mul                                        f64  8.0e-11
//! mul_broadcast_n1h_1ch                      f64  9.9e-11
//! mul_broadcast_some_axes_decided_at_run_time f64  1.8e-10
//! neg                                        f64  2.2e-11
//! nll_ignore_index_names_a_class_sum_int32   f64  3.3e-10
//! nll_mean                                   f64  2.5e-10
//! nll_of_log_softmax                         f64  1.2e-9
//! nll_weighted_ignore_index_nd               f64  3.1e-10
//! nll_weighted_none                          f64  1.8e-10
//! pad_axes_opset18                           f64  1.2e-10
//! pad_computed_from_shape                    f64  4.0e-11
//! pad_constant                               f64  7.4e-11
//! pad_constant_undeclared                    f64  1.8e-10
//! pad_negative                               f64  1.1e-10
//! pad_negative_attribute_opset10             f64  1.2e-10
//! pad_negative_axes_opset18                  f64  7.0e-11
//! pow                                        f64  2.0e-10
//! pow_broadcast_exponent                     f64  6.3e-10
//! pow_constant_exponent                      f64  6.3e-11
//! prelu_channel_slope                        f32  5.2e-5
//! prelu_one_slope                            f32  3.9e-5
//! reciprocal                                 f64  4.3e-11
//! reduce_l1_keep0                            f64  4.3e-10
//! reduce_l2_keep0                            f64  2.1e-10
//! reduce_l2_keep1                            f64  2.9e-10
//! reduce_log_sum_all_opset17                 f64  1.1e-9
//! reduce_log_sum_exp_keep0                   f64  1.0e-9
//! reduce_log_sum_exp_keep1                   f64  7.6e-10
//! reduce_log_sum_keep0                       f64  1.4e-9
//! reduce_max_keep0                           f64  4.3e-11
//! reduce_max_keep1                           f64  8.0e-11
//! reduce_mean_keep0                          f64  1.2e-10
//! reduce_mean_keep1                          f64  5.7e-11
//! reduce_mean_opset17_axes_attr              f64  3.3e-10
//! reduce_min_keep0                           f64  6.4e-11
//! reduce_min_keep1                           f64  1.5e-10
//! reduce_prod_all_opset17                    f64  6.1e-11
//! reduce_prod_keep0                          f64  1.2e-10
//! reduce_prod_keep1                          f64  6.4e-11
//! reduce_prod_zeros                          f64  6.6e-11
//! reduce_sum_all_axes                        f64  1.6e-10
//! reduce_sum_keep0                           f64  1.3e-10
//! reduce_sum_keep1                           f64  1.5e-10
//! reduce_sum_square_keep0                    f64  7.7e-11
//! reduce_sum_square_keep1                    f64  7.5e-11
//! relu                                       f64  4.0e-11
//! reshape                                    f64  1.5e-10
//! resize_cubic                               f32  9.9e-5
//! resize_cubic_exclude_outside               f32  1.4e-4
//! resize_linear_align_corners_sizes          f32  9.1e-5
//! resize_linear_asymmetric_1d                f32  8.2e-5
//! resize_linear_axes_opset18                 f32  9.1e-5
//! resize_linear_downsample                   f32  8.5e-5
//! resize_linear_half_pixel_2x                f32  1.3e-4
//! resize_linear_half_pixel_symmetric         f32  1.2e-4
//! resize_linear_middle_axis                  f32  7.1e-5
//! resize_linear_pytorch_half_pixel           f32  9.1e-5
//! resize_linear_sizes_from_shape             f32  1.1e-4
//! resize_nearest_1_5x                        f32  5.6e-5
//! resize_nearest_2x                          f32  5.7e-5
//! resize_nearest_sizes_prefer_ceil           f32  5.8e-5
//! resize_nearest_tf_half_pixel               f32  5.4e-5
//! resize_nearest_torch_upsample              f32  1.0e-4
//! reverse_sequence                           f64  8.3e-11
//! rms_norm_axis1_broadcast_scale             f64  2.6e-10
//! rms_norm_f32_default_stash                 f32  1.0e-4
//! rms_norm_last_axis                         f64  1.5e-10
//! rnn_sigmoid_bidirectional                  f32  4.4e-4
//! rnn_sigmoid_bidirectional_as_loop_f64      f64  8.0e-10
//! rnn_sigmoid_bidirectional_f64              f64  1.3e-9
//! rnn_tanh                                   f32  2.2e-4
//! rnn_tanh_f64                               f64  4.0e-10
//! scan                                       f32  9.2e-5
//! scan_axes_directions_f64                   f64  1.6e-10
//! scan_axes_directions_kept_f64              f64  3.1e-10
//! scan_f64                                   f64  6.3e-10
//! scan_kept_f64                              f64  2.0e-10
//! scatter_elements_add_repeated              f64  9.5e-11
//! scatter_elements_max                       f32  2.4e-5
//! scatter_elements_max_repeated              f64  2.0e-10
//! scatter_elements_max_ties                  f64  1.7e-10
//! scatter_elements_min                       f64  7.5e-11
//! scatter_elements_mul                       f32  7.4e-5
//! scatter_elements_mul_repeated_f64          f64  7.1e-11
//! scatter_elements_mul_zeros_f64             f64  6.5e-11
//! scatter_elements_none                      f64  6.9e-11
//! scatter_nd_add_repeated                    f64  6.1e-10
//! scatter_nd_max_repeated                    f64  1.3e-10
//! scatter_nd_min_elements                    f64  6.2e-11
//! scatter_nd_mul_repeated_f64                f64  1.8e-10
//! scatter_nd_none                            f64  4.0e-11
//! selu                                       f32  6.2e-5
//! selu_attrs                                 f32  5.7e-5
//! shared_parameter                           f64  1.2e-10
//! shared_parameter_same_node                 f64  3.4e-11
//! shrink                                     f32  1.2e-4
//! sigmoid                                    f64  2.6e-10
//! sin                                        f64  1.3e-10
//! sinh                                       f32  4.2e-5
//! slice_bounds_at_run_time                   f64  2.1e-11
//! slice_int32_bounds_at_run_time             f64  7.4e-11
//! slice_mixed_steps_3d                       f64  2.0e-11
//! slice_negative_bounds_at_run_time          f64  3.5e-11
//! slice_negative_step                        f64  6.1e-11
//! slice_negative_steps_both_axes             f64  2.6e-11
//! slice_steps                                f64  1.0e-10
//! slice_unit_steps                           f64  2.1e-10
//! softmax_axis1                              f64  4.3e-10
//! softmax_cross_entropy_ignore_index         f64  1.1e-9
//! softmax_cross_entropy_none                 f64  2.3e-10
//! softmax_cross_entropy_sum_nd               f64  1.2e-9
//! softmax_last                               f64  6.5e-10
//! softplus                                   f32  1.8e-4
//! softsign                                   f32  1.4e-4
//! space_to_depth                             f64  3.0e-10
//! split_equal_opset18                        f64  4.6e-11
//! split_only_later_output                    f64  6.4e-11
//! split_unused_output                        f64  4.5e-11
//! sqrt                                       f64  3.0e-10
//! squeeze                                    f64  1.3e-10
//! sub_broadcast                              f64  2.1e-10
//! sum_broadcast                              f64  2.1e-10
//! swish                                      f64  1.7e-10
//! swish_default_alpha                        f64  2.1e-10
//! tan                                        f32  2.3e-5
//! tanh                                       f64  1.1e-10
//! tf_while_with_if_kept_f64                  f64  3.1e-11
//! thresholded_relu                           f32  4.6e-5
//! tile                                       f64  1.5e-10
//! tile_undeclared                            f64  3.0e-10
//! top_k_largest                              f64  1.6e-11
//! top_k_smallest_axis0                       f64  2.1e-11
//! transpose                                  f64  6.3e-11
//! transpose_default_perm                     f64  1.1e-10
//! trilu_lower                                f64  8.7e-11
//! trilu_upper_k1                             f64  4.8e-11
//! unsqueeze                                  f64  7.7e-11
//! where_broadcast                            f64  1.1e-10

use crate::common;

use std::path::Path;

use ndarray::{ArrayD, IxDyn};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::ir::builder::{
    attr_float, attr_int, attr_ints, attr_string, attr_strings, tensor_bool, tensor_f32,
    tensor_f64, tensor_i64, Builder,
};
use onnx_ga::ir::{tensor_type, BodyId, Model, ValueId};
use onnx_ga::proto::{AttributeProto, ModelProto, OperatorSetIdProto, TensorProto};

const F32: i32 = 1;
const F64: i32 = 11;
const MAIN: BodyId = BodyId::MAIN;
const PIPELINE: &str = "autodiff(loss=loss,freeze=k_*),legalize-ort";
/// The same with every Loop kept a Loop (its gradient a Loop running backwards).
const PIPELINE_LOOPS_KEPT: &str = "autodiff(loss=loss,freeze=k_*,loops=keep),legalize-ort";

/// xorshift64*: deterministic, seeded per case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
}

/// A forward model under construction, in one float type.
/// A tensor the case feeds: name, shape, values.
type Probe = (String, Vec<i64>, Vec<f64>);

/// Rows of X [3, 4] that a ScatterElements on axis 0 writes three updates into, with repeats.
const REPEATED_ROWS: &[i64] = &[0, 2, 2, 1, 0, 0, 2, 1, 1, 2, 2, 1];

/// A case's builder: the outputs whose sum is the loss.
type Build = fn(&mut Net) -> Vec<ValueId>;

struct Net {
    model: Model,
    elem: i32,
    rng: Rng,
    /// Trainable initializers: name, dims, values.
    params: Vec<Probe>,
    /// The outputs' dims, given by a case whose forward op ONNX Runtime cannot run in this
    /// element type (the recurrent layers have no float64 kernels): the forward is then not
    /// run, and its float32 cases compare it with the gradient graph's instead.
    output_dims: Option<Vec<Vec<i64>>>,
    /// A case's own gradient tolerance, where float32 finite differences are noisier than
    /// the default allows (its float64 twin holds the gradients to 1e-6).
    tolerance: Option<f64>,
    /// A case's own tolerance for the forward's loss against the gradient graph's, where
    /// ONNX Runtime's graph optimisations round the gradient graph's forward differently.
    loss_tolerance: Option<f64>,
    /// The pipeline the case is differentiated by ([`PIPELINE`] unless the case says).
    pipeline: &'static str,
}

fn count(dims: &[i64]) -> usize {
    dims.iter().product::<i64>() as usize
}

impl Net {
    fn new(opset: i64, elem: i32, seed: u64) -> Net {
        let header = ModelProto {
            ir_version: Some(8),
            opset_import: vec![OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(opset),
            }],
            producer_name: Some("onnx-ga autodiff_rules".into()),
            graph: Some(Default::default()),
            ..Default::default()
        };
        let mut model = Model::from_proto(header);
        model.body_mut(MAIN).rest.name = Some("case".into());
        Net {
            model,
            elem,
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            params: Vec::new(),
            output_dims: None,
            tolerance: None,
            loss_tolerance: None,
            pipeline: PIPELINE,
        }
    }

    fn tensor(&self, dims: &[i64], values: &[f64]) -> TensorProto {
        if self.elem == F64 {
            tensor_f64(dims, values)
        } else {
            let v: Vec<f32> = values.iter().map(|x| *x as f32).collect();
            tensor_f32(dims, &v)
        }
    }

    fn random(&mut self, dims: &[i64], lo: f64, hi: f64) -> Vec<f64> {
        (0..count(dims)).map(|_| self.rng.uniform(lo, hi)).collect()
    }

    /// A trainable initializer with the given values.
    fn param_with(&mut self, name: &str, dims: &[i64], values: Vec<f64>) -> ValueId {
        assert_eq!(values.len(), count(dims), "{name}");
        // Store what the model holds (float32 rounding included).
        let values: Vec<f64> = if self.elem == F64 {
            values
        } else {
            values.iter().map(|x| *x as f32 as f64).collect()
        };
        let t = self.tensor(dims, &values);
        let v = self.model.add_initializer(MAIN, name, t);
        assert_eq!(
            self.model.name(v),
            name,
            "parameter names are unique per case"
        );
        self.params.push((name.to_string(), dims.to_vec(), values));
        v
    }

    /// Uniform in [lo, hi).
    fn param(&mut self, name: &str, dims: &[i64], lo: f64, hi: f64) -> ValueId {
        let v = self.random(dims, lo, hi);
        self.param_with(name, dims, v)
    }

    /// Uniform in [lo, hi), at least `margin` away from every kink.
    fn param_avoid(
        &mut self,
        name: &str,
        dims: &[i64],
        lo: f64,
        hi: f64,
        kinks: &[f64],
        margin: f64,
    ) -> ValueId {
        let values = (0..count(dims))
            .map(|_| loop {
                let x = self.rng.uniform(lo, hi);
                if kinks.iter().all(|k| (x - k).abs() >= margin) {
                    break x;
                }
            })
            .collect();
        self.param_with(name, dims, values)
    }

    /// Distinct values at least `step` apart (a shuffled grid plus small noise), so every
    /// max/min is unique by a clear margin.
    fn param_distinct(&mut self, name: &str, dims: &[i64], step: f64) -> ValueId {
        let n = count(dims);
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.rng.next() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let centre = (n as f64 - 1.0) / 2.0;
        let values = order
            .iter()
            .map(|k| (*k as f64 - centre) * step + self.rng.uniform(-0.1, 0.1) * step)
            .collect();
        self.param_with(name, dims, values)
    }

    /// A constant float initializer (frozen: its name starts with `k_`).
    fn konst(&mut self, name: &str, dims: &[i64], values: &[f64]) -> ValueId {
        let t = self.tensor(dims, values);
        self.model.add_initializer(MAIN, &format!("k_{name}"), t)
    }

    fn ints(&mut self, name: &str, dims: &[i64], values: &[i64]) -> ValueId {
        self.model
            .add_initializer(MAIN, name, tensor_i64(dims, values))
    }

    fn int32s(&mut self, name: &str, dims: &[i64], values: &[i32]) -> ValueId {
        let t = TensorProto {
            dims: dims.to_vec(),
            data_type: Some(6),
            int32_data: values.to_vec(),
            ..Default::default()
        };
        self.model.add_initializer(MAIN, name, t)
    }

    fn bools(&mut self, name: &str, dims: &[i64], values: &[bool]) -> ValueId {
        self.model
            .add_initializer(MAIN, name, tensor_bool(dims, values))
    }

    /// Declares `v`'s type (for a value whose shape the autodiff cannot derive).
    fn declare(&mut self, v: ValueId, dims: &[i64]) {
        self.model.set_value_type(v, tensor_type(self.elem, dims));
    }

    fn op(&mut self, op: &str, inputs: &[ValueId], attrs: Vec<AttributeProto>) -> ValueId {
        Builder::new(&mut self.model, MAIN, "test").op(op, inputs, attrs, &op.to_lowercase())
    }

    /// A node with optional inputs and `outputs` outputs.
    fn node(
        &mut self,
        op: &str,
        inputs: &[Option<ValueId>],
        outputs: usize,
        attrs: Vec<AttributeProto>,
    ) -> Vec<ValueId> {
        let hints: Vec<String> = (0..outputs)
            .map(|i| format!("{}_{i}", op.to_lowercase()))
            .collect();
        let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
        let n = Builder::new(&mut self.model, MAIN, "test").node(op, "", inputs, &hints, attrs);
        (0..outputs).map(|i| self.model.output(n, i)).collect()
    }

    /// Appends `loss = Σ_i ReduceSum(Mul(Y_i, R_i))`, each R_i random of Y_i's shape (read
    /// from a forward run), and returns the forward model.
    fn finish(mut self, ys: &[ValueId]) -> (ModelProto, Vec<Probe>) {
        let mut probe = self.model.clone();
        for y in ys {
            probe.add_output(MAIN, *y, None);
        }
        let all_dims: Vec<Vec<i64>> = match self.output_dims.clone() {
            Some(d) => d,
            None => run(&probe.to_proto(), &[])
                .iter()
                .map(|(_, t)| t.shape().iter().map(|d| *d as i64).collect())
                .collect(),
        };
        let mut terms = Vec::new();
        for (i, dims) in all_dims.into_iter().enumerate() {
            let r = self.random(&dims, -1.0, 1.0);
            let r = self.konst(&format!("R{i}"), &dims, &r);
            let m = self.op("Mul", &[ys[i], r], vec![]);
            terms.push(m);
        }
        let mut b = Builder::new(&mut self.model, MAIN, "test");
        let mut total: Option<ValueId> = None;
        let last = terms.len() - 1;
        for (i, m) in terms.into_iter().enumerate() {
            let hint = if i == last && total.is_none() {
                "loss"
            } else {
                "loss_term"
            };
            let s = b.op("ReduceSum", &[m], vec![attr_int("keepdims", 0)], hint);
            total = Some(match total {
                None => s,
                Some(acc) => {
                    let hint = if i == last { "loss" } else { "loss_acc" };
                    b.op("Add", &[acc, s], vec![], hint)
                }
            });
        }
        let loss = total.expect("at least one output");
        assert_eq!(self.model.name(loss), "loss");
        self.model
            .add_output(MAIN, loss, Some(tensor_type(self.elem, &[])));
        (self.model.to_proto(), self.params)
    }
}

fn session(model: &ModelProto) -> OrtSession {
    OrtSession::new(model, &SessionOptions::default()).unwrap_or_else(|e| panic!("session: {e}"))
}

fn run(model: &ModelProto, feeds: &[(&str, &Tensor)]) -> Vec<(String, Tensor)> {
    session(model)
        .run(feeds)
        .unwrap_or_else(|e| panic!("run: {e}"))
}

fn values(t: &Tensor) -> Vec<f64> {
    match t {
        Tensor::F64(a) => a.iter().copied().collect(),
        Tensor::F32(a) => a.iter().map(|x| *x as f64).collect(),
        other => panic!("not a float tensor: {other:?}"),
    }
}

fn to_tensor(elem: i32, dims: &[i64], values: &[f64]) -> Tensor {
    let shape: Vec<usize> = dims.iter().map(|d| *d as usize).collect();
    if elem == F64 {
        Tensor::F64(ArrayD::from_shape_vec(IxDyn(&shape), values.to_vec()).unwrap())
    } else {
        let v: Vec<f32> = values.iter().map(|x| *x as f32).collect();
        Tensor::F32(ArrayD::from_shape_vec(IxDyn(&shape), v).unwrap())
    }
}

fn norm(v: impl Iterator<Item = f64>) -> f64 {
    v.map(|x| x * x).sum::<f64>().sqrt()
}

/// A case's parameters' seed, from its name.
fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Builds the case, differentiates it, checks every parameter's gradient against central
/// differences; returns the largest relative error.
fn check(name: &str, opset: i64, elem: i32, build: impl FnOnce(&mut Net) -> Vec<ValueId>) {
    if !common::ort_available() {
        return;
    }
    let mut net = Net::new(opset, elem, seed_of(name));
    let ys = build(&mut net);
    let forward_runs = net.output_dims.is_none();
    let tolerance = net.tolerance;
    let loss_tolerance = net.loss_tolerance;
    let pipeline = net.pipeline;
    let (forward, params) = net.finish(&ys);
    assert!(!params.is_empty(), "{name}: no parameters");
    // The forward as ONNX Runtime runs it, before any normalisation (unrolled recurrent
    // layers must compute what ONNX Runtime's own kernels compute). BatchNormalization on
    // running statistics and Dropout change on purpose (to their training forms); a
    // BatchNormalization on statistics the graph computes is written out and must not.
    let trains_differently = forward.graph.as_ref().is_some_and(|g| {
        let running = |n: &onnx_ga::proto::NodeProto| {
            n.input
                .get(3)
                .is_some_and(|m| g.initializer.iter().any(|i| i.name() == m))
        };
        g.node.iter().any(|n| {
            n.op_type() == "Dropout" || (n.op_type() == "BatchNormalization" && running(n))
        })
    });
    let forward_loss = forward_runs.then(|| {
        run(&forward, &[])
            .into_iter()
            .find(|(o, _)| o == "loss")
            .map(|(_, t)| values(&t)[0])
            .unwrap_or_else(|| panic!("{name}: the forward has no loss"))
    });
    let graph = onnx_ga::signature::forward(forward, Path::new("case.onnx"));
    let step = onnx_ga::step::build_step(graph, pipeline, true)
        .unwrap_or_else(|e| panic!("{name}: {pipeline}: {e}"));
    let proto = step.model.to_proto();
    let mut s = session(&proto);
    let base: Vec<(String, Tensor)> = s.run(&[]).unwrap_or_else(|e| panic!("{name}: run: {e}"));
    let graph_loss = base
        .iter()
        .find(|(o, _)| o == "loss")
        .map(|(_, t)| values(t)[0])
        .unwrap_or_else(|| panic!("{name}: the gradient graph has no loss"));
    let loss_tol = loss_tolerance.unwrap_or(if elem == F64 { 1e-12 } else { 1e-5 });
    if let (false, Some(forward_loss)) = (trains_differently, forward_loss) {
        assert!(
            (graph_loss - forward_loss).abs() <= loss_tol * forward_loss.abs().max(1.0),
            "{name}: the gradient graph's loss {graph_loss} differs from the forward's {forward_loss}"
        );
    }
    let get = |outs: &[(String, Tensor)], n: &str| -> Vec<f64> {
        let t = outs.iter().find(|(o, _)| o == n).unwrap_or_else(|| {
            panic!(
                "{name}: no output '{n}' (outputs: {:?})",
                outs.iter().map(|(o, _)| o.as_str()).collect::<Vec<_>>()
            )
        });
        values(&t.1)
    };
    let grad_outputs: Vec<&str> = base
        .iter()
        .map(|(o, _)| o.as_str())
        .filter(|o| o.ends_with("_grad"))
        .collect();
    let mut expected: Vec<String> = params.iter().map(|(p, ..)| format!("{p}_grad")).collect();
    expected.sort();
    let mut got: Vec<String> = grad_outputs.iter().map(|s| s.to_string()).collect();
    got.sort();
    assert_eq!(got, expected, "{name}: gradient outputs");

    let (h, tol) = if elem == F64 {
        (1e-6, 1e-6)
    } else {
        (1e-3, 1e-3)
    };
    let tol = tolerance.unwrap_or(tol);
    let mut worst = 0.0f64;
    let mut report = Vec::new();
    for (p, dims, v0) in &params {
        let g = get(&base, &format!("{p}_grad"));
        assert_eq!(g.len(), v0.len(), "{name}: {p}_grad size");
        let mut fd = Vec::with_capacity(v0.len());
        for i in 0..v0.len() {
            let mut loss_at = |x: f64| -> (f64, f64) {
                let mut v = v0.clone();
                v[i] = x;
                let t = to_tensor(elem, dims, &v);
                let outs = s
                    .run(&[(p.as_str(), &t)])
                    .unwrap_or_else(|e| panic!("{name}: run: {e}"));
                let stored = values(&t)[i];
                (get(&outs, "loss")[0], stored)
            };
            let (lp, xp) = loss_at(v0[i] + h);
            let (lm, xm) = loss_at(v0[i] - h);
            fd.push((lp - lm) / (xp - xm));
        }
        let diff = norm(g.iter().zip(&fd).map(|(a, b)| a - b));
        let scale = norm(fd.iter().copied()).max(1e-30);
        let rel = diff / scale;
        report.push(format!("{p}: {rel:.1e} (|fd| {scale:.2e})"));
        if rel > worst || rel.is_nan() {
            worst = rel;
        }
        assert!(
            norm(g.iter().copied()) > 0.0 || scale == 1e-30,
            "{name}: {p}: zero gradient"
        );
    }
    let kind = if elem == F64 { "f64" } else { "f32" };
    eprintln!("MEASURED {name} {kind} {worst:.1e} [{}]", report.join(", "));
    assert!(
        worst <= tol,
        "{name} ({kind}): relative error {worst:e} > {tol:e}: {}",
        report.join(", ")
    );
}

/// One #[test] per case: `name: opset, elem => |net| { ... outputs }`.
macro_rules! cases {
    ($($(#[$meta:meta])* $name:ident: $opset:expr, $elem:expr => $build:expr;)*) => {$(
        #[test]
        $(#[$meta])*
        fn $name() {
            check(stringify!($name), $opset, $elem, $build);
        }
    )*};
}

/// `[Shape(x)[1] / 2]` through float64 and back (a float64 case's constant halves it): a
/// bound no shape arithmetic folds.
/// `[k]` as an int64 tensor computed from the values of `x` (`k · max(exp(x) > 0)`), so the
/// shape facts cannot know it.
fn unknown_to_the_facts(n: &mut Net, x: ValueId, k: i64) -> ValueId {
    let e = n.op("Exp", &[x], vec![]);
    let zero = n.konst(&format!("zero_{k}"), &[1], &[0.0]);
    let positive = n.op("Greater", &[e, zero], vec![]);
    let ones = n.op("Cast", &[positive], vec![attr_int("to", 7)]);
    let one = n.op("ReduceMax", &[ones], vec![attr_int("keepdims", 0)]);
    let k = n.ints(&format!("times_{k}"), &[1], &[k]);
    n.op("Mul", &[one, k], vec![])
}

/// `x` reshaped to `[rows, cols]`, its rows a number the shape facts cannot know.
fn rows_unknown_to_the_facts(n: &mut Net, x: ValueId, rows: i64, cols: i64) -> ValueId {
    let rows = unknown_to_the_facts(n, x, rows);
    let cols = n.ints("cols", &[1], &[cols]);
    let shape = n.op("Concat", &[rows, cols], vec![attr_int("axis", 0)]);
    n.op("Reshape", &[x, shape], vec![])
}

fn half_of_width(n: &mut Net, x: ValueId) -> ValueId {
    let shape = n.op("Shape", &[x], vec![]);
    let one = n.ints("width_at", &[1], &[1]);
    let two = n.ints("width_to", &[1], &[2]);
    let width = n.op("Slice", &[shape, one, two], vec![]);
    let f = n.op("Cast", &[width], vec![attr_int("to", F64 as i64)]);
    let halves = n.konst("halves", &[1], &[0.5]);
    let halved = n.op("Mul", &[f, halves], vec![]);
    n.op("Cast", &[halved], vec![attr_int("to", 7)])
}

fn pair_minmax(n: &mut Net, a_dims: &[i64], b_dims: &[i64]) -> (ValueId, ValueId) {
    // b random; a = b (broadcast) ± an offset in [0.1, 1], so a ≠ b by a clear margin.
    let bv = n.random(b_dims, -1.0, 1.0);
    let cols = count(b_dims);
    let av: Vec<f64> = (0..count(a_dims))
        .map(|i| {
            let off = n.rng.uniform(0.1, 1.0);
            let sign = if n.rng.unit() < 0.5 { -1.0 } else { 1.0 };
            bv[i % cols] + sign * off
        })
        .collect();
    let a = n.param_with("A", a_dims, av);
    let b = n.param_with("B", b_dims, bv);
    (a, b)
}

fn gemm_case(n: &mut Net, trans_a: bool, trans_b: bool) -> Vec<ValueId> {
    let (m, k, nn) = (3, 4, 5);
    let a_dims = if trans_a { [k, m] } else { [m, k] };
    let b_dims = if trans_b { [nn, k] } else { [k, nn] };
    let a = n.param("A", &a_dims, -1.0, 1.0);
    let b = n.param("B", &b_dims, -1.0, 1.0);
    let c = n.param("C", &[nn], -1.0, 1.0);
    vec![n.op(
        "Gemm",
        &[a, b, c],
        vec![
            attr_int("transA", trans_a as i64),
            attr_int("transB", trans_b as i64),
            attr_float("alpha", 0.7),
            attr_float("beta", 1.3),
        ],
    )]
}

fn conv_case(
    n: &mut Net,
    x_dims: &[i64],
    w_dims: &[i64],
    attrs: Vec<AttributeProto>,
) -> Vec<ValueId> {
    let x = n.param("X", x_dims, -1.0, 1.0);
    let w = n.param("W", w_dims, -1.0, 1.0);
    let b = n.param("Bias", &[w_dims[0]], -1.0, 1.0);
    vec![n.op("Conv", &[x, w, b], attrs)]
}

fn conv_transpose_case(
    n: &mut Net,
    x_dims: &[i64],
    w_dims: &[i64],
    bias: bool,
    attrs: Vec<AttributeProto>,
) -> Vec<ValueId> {
    let group = attrs
        .iter()
        .find(|a| a.name() == "group")
        .map_or(1, |a| a.i());
    let x = n.param("X", x_dims, -1.0, 1.0);
    let w = n.param("W", w_dims, -1.0, 1.0);
    let mut inputs = vec![x, w];
    if bias {
        inputs.push(n.param("Bias", &[w_dims[1] * group], -1.0, 1.0));
    }
    vec![n.op("ConvTranspose", &inputs, attrs)]
}

fn reduce_case(n: &mut Net, op: &str, keepdims: i64) -> Vec<ValueId> {
    let x = if matches!(op, "ReduceMax" | "ReduceMin") {
        n.param_distinct("X", &[3, 4, 2], 0.1)
    } else {
        n.param("X", &[3, 4, 2], -1.0, 1.0)
    };
    let axes = n.ints("axes", &[1], &[1]);
    vec![n.op(op, &[x, axes], vec![attr_int("keepdims", keepdims)])]
}

fn unary(n: &mut Net, op: &str, lo: f64, hi: f64, attrs: Vec<AttributeProto>) -> Vec<ValueId> {
    let x = n.param("X", &[3, 4], lo, hi);
    vec![n.op(op, &[x], attrs)]
}

fn unary_avoid(
    n: &mut Net,
    op: &str,
    lo: f64,
    hi: f64,
    kinks: &[f64],
    attrs: Vec<AttributeProto>,
) -> Vec<ValueId> {
    let x = n.param_avoid("X", &[3, 4], lo, hi, kinks, 0.05);
    vec![n.op(op, &[x], attrs)]
}

/// Q, K and V of an Attention case (parameters of the given shapes). The gradient graph's
/// forward is the attention written out (`autodiff/expand_attention.rs`); ONNX Runtime's
/// graph optimisations fold its two `sqrt(scale)` factors into one float32 `alpha` of a
/// fused MatMul, 1e-8 off in float64 (bit-identical to ONNX Runtime's own kernel with
/// optimisations off, measured), so the losses are compared to 1e-7.
fn attention_inputs(n: &mut Net, q: &[i64], k: &[i64], v: &[i64]) -> (ValueId, ValueId, ValueId) {
    if n.elem == F64 {
        n.loss_tolerance = Some(1e-7);
    }
    (
        n.param("Q", q, -1.0, 1.0),
        n.param("K", k, -1.0, 1.0),
        n.param("V", v, -1.0, 1.0),
    )
}

cases! {
    // ---- elementwise
    add: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], -1.0, 1.0);
        let b = n.param("B", &[3, 4], -1.0, 1.0);
        vec![n.op("Add", &[a, b], vec![])]
    };
    add_broadcast_nc_c: 17, F64 => |n| {
        let a = n.param("A", &[4, 3], -1.0, 1.0);
        let b = n.param("B", &[3], -1.0, 1.0);
        vec![n.op("Add", &[a, b], vec![])]
    };
    // x's rows are a size the shape facts cannot know (1 at run time): its gradient is
    // the sum over the rows, decided at run time.
    add_broadcast_decided_at_run_time: 17, F64 => |n| {
        let a = n.param("A", &[3], -1.0, 1.0);
        let b = n.param("B", &[2, 3], -1.0, 1.0);
        let x = rows_unknown_to_the_facts(n, a, 1, 3);
        vec![n.op("Add", &[x, b], vec![])]
    };
    // The same, 2 rows at run time: nothing is summed.
    add_not_broadcast_decided_at_run_time: 17, F64 => |n| {
        let a = n.param("A", &[6], -1.0, 1.0);
        let b = n.param("B", &[2, 3], -1.0, 1.0);
        let x = rows_unknown_to_the_facts(n, a, 2, 3);
        vec![n.op("Add", &[x, b], vec![])]
    };
    // x [?, 1, ?] = [1, 1, 4] against [2, 3, 5, 4]: a leading axis, an unsure axis that is
    // broadcast, a known one, and an unsure one that is not.
    mul_broadcast_some_axes_decided_at_run_time: 17, F64 => |n| {
        let a = n.param("A", &[4], -1.0, 1.0);
        let b = n.param("B", &[2, 3, 5, 4], -1.0, 1.0);
        let first = unknown_to_the_facts(n, a, 1);
        let middle = n.ints("middle", &[1], &[1]);
        let last = unknown_to_the_facts(n, a, 4);
        let shape = n.op("Concat", &[first, middle, last], vec![attr_int("axis", 0)]);
        let x = n.op("Reshape", &[a, shape], vec![]);
        vec![n.op("Mul", &[b, x], vec![])]
    };
    sub_broadcast: 17, F64 => |n| {
        let a = n.param("A", &[4], -1.0, 1.0);
        let b = n.param("B", &[3, 4], -1.0, 1.0);
        vec![n.op("Sub", &[a, b], vec![])]
    };
    mul: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], -1.0, 1.0);
        let b = n.param("B", &[3, 4], -1.0, 1.0);
        vec![n.op("Mul", &[a, b], vec![])]
    };
    mul_broadcast_n1h_1ch: 17, F64 => |n| {
        let a = n.param("A", &[2, 1, 4], -1.0, 1.0);
        let b = n.param("B", &[1, 3, 4], -1.0, 1.0);
        vec![n.op("Mul", &[a, b], vec![])]
    };
    div: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], -1.0, 1.0);
        let b = n.param_avoid("B", &[3, 4], -1.5, 1.5, &[0.0], 0.5);
        vec![n.op("Div", &[a, b], vec![])]
    };
    div_broadcast: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], -1.0, 1.0);
        let b = n.param_avoid("B", &[1, 4], -1.5, 1.5, &[0.0], 0.5);
        vec![n.op("Div", &[a, b], vec![])]
    };
    neg: 17, F64 => |n| unary(n, "Neg", -1.0, 1.0, vec![]);
    pow: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], 0.5, 2.0);
        let b = n.param("B", &[3, 4], -1.5, 2.0);
        vec![n.op("Pow", &[a, b], vec![])]
    };
    pow_constant_exponent: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], -1.5, 1.5);
        let e = n.konst("e", &[], &[3.0]);
        vec![n.op("Pow", &[a, e], vec![])]
    };
    pow_broadcast_exponent: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], 0.5, 2.0);
        let b = n.param("B", &[4], -1.5, 2.0);
        vec![n.op("Pow", &[a, b], vec![])]
    };
    sqrt: 17, F64 => |n| unary(n, "Sqrt", 0.5, 2.0, vec![]);
    reciprocal: 17, F64 => |n| unary_avoid(n, "Reciprocal", -2.0, 2.0, &[0.0], vec![]);
    exp: 17, F64 => |n| unary(n, "Exp", -1.0, 1.0, vec![]);
    log: 17, F64 => |n| unary(n, "Log", 0.3, 2.0, vec![]);
    abs: 17, F64 => |n| unary_avoid(n, "Abs", -1.5, 1.5, &[0.0], vec![]);
    erf: 17, F32 => |n| unary(n, "Erf", -1.5, 1.5, vec![]);
    sum_broadcast: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], -1.0, 1.0);
        let b = n.param("B", &[4], -1.0, 1.0);
        let c = n.param("C", &[3, 1], -1.0, 1.0);
        vec![n.op("Sum", &[a, b, c], vec![])]
    };
    mean_broadcast: 17, F32 => |n| {
        let a = n.param("A", &[3, 4], -1.0, 1.0);
        let b = n.param("B", &[4], -1.0, 1.0);
        let c = n.param("C", &[3, 1], -1.0, 1.0);
        vec![n.op("Mean", &[a, b, c], vec![])]
    };
    min_broadcast: 17, F64 => |n| {
        let (a, b) = pair_minmax(n, &[3, 4], &[4]);
        vec![n.op("Min", &[a, b], vec![])]
    };
    max_broadcast: 17, F64 => |n| {
        let (a, b) = pair_minmax(n, &[3, 4], &[4]);
        vec![n.op("Max", &[a, b], vec![])]
    };
    max: 17, F64 => |n| {
        let (a, b) = pair_minmax(n, &[3, 4], &[3, 4]);
        vec![n.op("Max", &[a, b], vec![])]
    };
    where_broadcast: 17, F64 => |n| {
        let cond: Vec<bool> = (0..12).map(|_| n.rng.unit() < 0.5).collect();
        let c = n.bools("cond", &[3, 4], &cond);
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let y = n.param("Y", &[4], -1.0, 1.0);
        vec![n.op("Where", &[c, x, y], vec![])]
    };

    // ---- activations
    relu: 17, F64 => |n| unary_avoid(n, "Relu", -1.5, 1.5, &[0.0], vec![]);
    sigmoid: 17, F64 => |n| unary(n, "Sigmoid", -2.0, 2.0, vec![]);
    tanh: 17, F64 => |n| unary(n, "Tanh", -2.0, 2.0, vec![]);
    leaky_relu: 17, F64 => |n| unary_avoid(n, "LeakyRelu", -1.5, 1.5, &[0.0], vec![attr_float("alpha", 0.1)]);
    elu: 17, F32 => |n| unary_avoid(n, "Elu", -1.5, 1.5, &[0.0], vec![attr_float("alpha", 0.7)]);
    gelu: 20, F32 => |n| unary(n, "Gelu", -2.0, 2.0, vec![]);
    gelu_tanh: 20, F64 => |n| unary(n, "Gelu", -2.0, 2.0, vec![attr_string("approximate", "tanh")]);
    hard_sigmoid: 17, F32 => |n| {
        // alpha x + beta leaves [0, 1] at x = -4/3 and x = 2.
        unary_avoid(n, "HardSigmoid", -3.0, 3.0, &[-4.0 / 3.0, 2.0],
            vec![attr_float("alpha", 0.3), attr_float("beta", 0.4)])
    };
    hard_swish: 17, F32 => |n| unary_avoid(n, "HardSwish", -4.5, 4.5, &[-3.0, 3.0], vec![]);
    softplus: 17, F32 => |n| unary(n, "Softplus", -2.0, 2.0, vec![]);
    clip: 17, F64 => |n| {
        let x = n.param_avoid("X", &[3, 4], -1.5, 1.5, &[-0.5, 0.6], 0.05);
        let lo = n.konst("min", &[], &[-0.5]);
        let hi = n.konst("max", &[], &[0.6]);
        vec![n.op("Clip", &[x, lo, hi], vec![])]
    };
    // Learned bounds (PACT's clipping level): each takes the dY of the elements it set.
    clip_learned_bounds: 17, F64 => |n| {
        let x = n.param_avoid("X", &[3, 4], -1.5, 1.5, &[-0.5, 0.6], 0.05);
        let lo = n.param_with("min", &[], vec![-0.5]);
        let hi = n.param_with("max", &[], vec![0.6]);
        vec![n.op("Clip", &[x, lo, hi], vec![])]
    };
    // min > max: every element is max; X and min get nothing.
    clip_crossed_bounds: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.5, 1.5);
        let lo = n.param_with("min", &[], vec![0.7]);
        let hi = n.param_with("max", &[], vec![0.2]);
        vec![n.op("Clip", &[x, lo, hi], vec![])]
    };
    clip_max_only: 17, F64 => |n| {
        let x = n.param_avoid("X", &[3, 4], -1.5, 1.5, &[0.6], 0.05);
        let hi = n.konst("max", &[], &[0.6]);
        n.node("Clip", &[Some(x), None, Some(hi)], 1, vec![])
    };

    // ---- MatMul, Gemm
    matmul_2d: 17, F64 => |n| {
        let a = n.param("A", &[3, 4], -1.0, 1.0);
        let b = n.param("B", &[4, 5], -1.0, 1.0);
        vec![n.op("MatMul", &[a, b], vec![])]
    };
    matmul_batched: 17, F64 => |n| {
        let a = n.param("A", &[2, 3, 4], -1.0, 1.0);
        let b = n.param("B", &[2, 4, 5], -1.0, 1.0);
        vec![n.op("MatMul", &[a, b], vec![])]
    };
    matmul_btk_kn: 17, F64 => |n| {
        let a = n.param("A", &[2, 3, 4], -1.0, 1.0);
        let b = n.param("B", &[4, 5], -1.0, 1.0);
        vec![n.op("MatMul", &[a, b], vec![])]
    };
    matmul_broadcast_batch: 17, F64 => |n| {
        let a = n.param("A", &[2, 1, 3, 4], -1.0, 1.0);
        let b = n.param("B", &[3, 4, 2], -1.0, 1.0);
        vec![n.op("MatMul", &[a, b], vec![])]
    };
    gemm_nn: 17, F64 => |n| gemm_case(n, false, false);
    gemm_tn: 17, F64 => |n| gemm_case(n, true, false);
    gemm_nt: 17, F64 => |n| gemm_case(n, false, true);
    gemm_tt: 17, F64 => |n| gemm_case(n, true, true);

    // ---- Conv, pooling
    conv_plain: 17, F32 => |n| conv_case(n, &[1, 2, 5, 5], &[3, 2, 3, 3], vec![]);
    conv_stride_pad: 17, F32 => |n| conv_case(n, &[2, 2, 5, 5], &[2, 2, 3, 3],
        vec![attr_ints("strides", &[2, 2]), attr_ints("pads", &[1, 1, 1, 1])]);
    conv_group: 17, F32 => |n| conv_case(n, &[1, 4, 4, 4], &[4, 2, 3, 3],
        vec![attr_int("group", 2), attr_ints("pads", &[1, 0, 1, 0])]);
    conv_dilation: 17, F32 => |n| conv_case(n, &[1, 2, 6, 6], &[2, 2, 2, 2],
        vec![attr_ints("dilations", &[2, 2])]);
    // 16 input channels, stride 1: dW is lowered on two slices of X's channels.
    conv_channel_slices: 17, F32 => |n| conv_case(n, &[1, 16, 3, 3], &[2, 16, 3, 2],
        vec![attr_ints("pads", &[1, 0, 1, 1])]);
    conv_transpose_plain: 17, F32 => |n| conv_transpose_case(n, &[1, 2, 4, 4], &[2, 3, 3, 3], true, vec![]);
    conv_transpose_stride_pads_output_padding: 17, F32 => |n| conv_transpose_case(n, &[2, 2, 3, 3], &[2, 2, 3, 3], true, vec![
        attr_ints("strides", &[2, 3]),
        attr_ints("pads", &[1, 0, 0, 2]),
        attr_ints("output_padding", &[1, 2]),
    ]);
    conv_transpose_group_dilation_no_bias: 17, F32 => |n| conv_transpose_case(n, &[1, 4, 3, 3], &[4, 2, 2, 2], false, vec![
        attr_int("group", 2),
        attr_ints("dilations", &[2, 1]),
        attr_ints("pads", &[0, 1, 1, 0]),
    ]);
    conv_transpose_1d_no_bias: 17, F32 => |n| conv_transpose_case(n, &[2, 3, 5], &[3, 2, 3], false, vec![
        attr_ints("strides", &[3]),
        attr_ints("pads", &[1, 2]),
        attr_ints("dilations", &[2]),
        attr_ints("output_padding", &[2]),
    ]);
    conv_transpose_1d_group_bias: 17, F32 => |n| conv_transpose_case(n, &[1, 6, 4], &[6, 1, 2], true, vec![
        attr_int("group", 3),
        attr_ints("strides", &[2]),
        attr_ints("kernel_shape", &[2]),
    ]);
    max_pool_disjoint: 17, F32 => |n| {
        let x = n.param_distinct("X", &[1, 2, 4, 4], 0.1);
        vec![n.op("MaxPool", &[x], vec![attr_ints("kernel_shape", &[2, 2]), attr_ints("strides", &[2, 2])])]
    };
    max_pool_overlapping: 17, F64 => |n| {
        let x = n.param_distinct("X", &[1, 2, 4, 4], 0.1);
        vec![n.op("MaxPool", &[x], vec![
            attr_ints("kernel_shape", &[3, 3]),
            attr_ints("strides", &[1, 1]),
            attr_ints("pads", &[1, 1, 1, 1]),
        ])]
    };
    average_pool: 17, F32 => |n| {
        let x = n.param("X", &[1, 2, 4, 4], -1.0, 1.0);
        vec![n.op("AveragePool", &[x], vec![attr_ints("kernel_shape", &[2, 2]), attr_ints("strides", &[2, 2])])]
    };
    average_pool_overlapping_padded: 17, F32 => |n| {
        let x = n.param("X", &[1, 2, 4, 4], -1.0, 1.0);
        vec![n.op("AveragePool", &[x], vec![
            attr_ints("kernel_shape", &[3, 3]),
            attr_ints("strides", &[1, 1]),
            attr_ints("pads", &[1, 1, 1, 1]),
            attr_int("count_include_pad", 1),
        ])]
    };
    // Windows of their own sizes: the last of a ceil_mode axis runs past the padded input
    // (divides by what it covers), count_include_pad = 0 divides by the input it covers.
    average_pool_ceil_mode: 19, F32 => |n| {
        let x = n.param("X", &[1, 2, 5, 6], -1.0, 1.0);
        vec![n.op("AveragePool", &[x], vec![
            attr_ints("kernel_shape", &[2, 3]),
            attr_ints("strides", &[2, 2]),
            attr_int("ceil_mode", 1),
        ])]
    };
    average_pool_ceil_mode_padded: 19, F32 => |n| {
        let x = n.param("X", &[1, 2, 6, 6], -1.0, 1.0);
        vec![n.op("AveragePool", &[x], vec![
            attr_ints("kernel_shape", &[3, 3]),
            attr_ints("strides", &[2, 2]),
            attr_ints("pads", &[1, 0, 1, 1]),
            attr_int("ceil_mode", 1),
            attr_int("count_include_pad", 1),
        ])]
    };
    average_pool_exclude_pad: 19, F32 => |n| {
        let x = n.param("X", &[1, 2, 4, 5], -1.0, 1.0);
        vec![n.op("AveragePool", &[x], vec![
            attr_ints("kernel_shape", &[3, 3]),
            attr_ints("strides", &[1, 2]),
            attr_ints("pads", &[1, 1, 1, 0]),
        ])]
    };
    average_pool_1d_ceil_exclude_pad: 19, F32 => |n| {
        let x = n.param("X", &[2, 2, 7], -1.0, 1.0);
        vec![n.op("AveragePool", &[x], vec![
            attr_ints("kernel_shape", &[3]),
            attr_ints("strides", &[2]),
            attr_ints("pads", &[2, 1]),
            attr_int("ceil_mode", 1),
        ])]
    };
    // EfficientNet's head (Hugging Face): AvgPool2d(1280, ceil_mode=True) on a 1x1 map, a
    // kernel larger than the input whose one window is a global mean.
    average_pool_kernel_over_input: 19, F32 => |n| {
        let x = n.param("X", &[2, 3, 3, 2], -1.0, 1.0);
        vec![n.op("AveragePool", &[x], vec![
            attr_ints("kernel_shape", &[16, 16]),
            attr_ints("strides", &[16, 16]),
            attr_int("ceil_mode", 1),
            attr_int("count_include_pad", 1),
        ])]
    };
    global_average_pool: 17, F32 => |n| {
        let x = n.param("X", &[2, 3, 3, 3], -1.0, 1.0);
        vec![n.op("GlobalAveragePool", &[x], vec![])]
    };

    // ---- normalisation
    layer_norm_last_axis: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let s = n.param("Scale", &[4], 0.5, 1.5);
        let b = n.param("Bias", &[4], -1.0, 1.0);
        vec![n.op("LayerNormalization", &[x, s, b], vec![attr_int("axis", -1), attr_float("epsilon", 1e-5)])]
    };
    layer_norm_axis1: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let s = n.param("Scale", &[3, 4], 0.5, 1.5);
        let b = n.param("Bias", &[3, 4], -1.0, 1.0);
        vec![n.op("LayerNormalization", &[x, s, b], vec![attr_int("axis", 1), attr_float("epsilon", 1e-5)])]
    };
    group_norm_opset18_per_group: 18, F64 => |n| {
        let x = n.param("X", &[2, 4, 3, 2], -1.0, 1.0);
        let s = n.param("Scale", &[2], 0.5, 1.5);
        let b = n.param("Bias", &[2], -1.0, 1.0);
        vec![n.op("GroupNormalization", &[x, s, b], vec![attr_int("num_groups", 2), attr_float("epsilon", 1e-5)])]
    };
    group_norm_opset18_one_group: 18, F64 => |n| {
        let x = n.param("X", &[3, 3, 4], -1.0, 1.0);
        let s = n.param("Scale", &[1], 0.5, 1.5);
        let b = n.param("Bias", &[1], -1.0, 1.0);
        vec![n.op("GroupNormalization", &[x, s, b], vec![attr_int("num_groups", 1)])]
    };
    group_norm_opset21_per_channel: 21, F64 => |n| {
        // stash_type 11: the first stage in float64 too (the default, 1, is float32).
        let x = n.param("X", &[2, 6, 5], -1.0, 1.0);
        let s = n.param("Scale", &[6], 0.5, 1.5);
        let b = n.param("Bias", &[6], -1.0, 1.0);
        vec![n.op("GroupNormalization", &[x, s, b], vec![
            attr_int("num_groups", 3), attr_float("epsilon", 1e-3), attr_int("stash_type", 11),
        ])]
    };
    group_norm_opset21_groups_equal_channels: 21, F64 => |n| {
        // G = C: InstanceNormalization's math (which has no float64 kernel) in float64.
        let x = n.param("X", &[2, 3, 2, 3], -1.0, 1.0);
        let s = n.param("Scale", &[3], 0.5, 1.5);
        let b = n.param("Bias", &[3], -1.0, 1.0);
        vec![n.op("GroupNormalization", &[x, s, b], vec![attr_int("num_groups", 3), attr_int("stash_type", 11)])]
    };
    group_norm_opset21_f32_default_stash: 21, F32 => |n| {
        let x = n.param("X", &[2, 4, 2, 3], -1.0, 1.0);
        let s = n.param("Scale", &[4], 0.5, 1.5);
        let b = n.param("Bias", &[4], -1.0, 1.0);
        vec![n.op("GroupNormalization", &[x, s, b], vec![attr_int("num_groups", 2)])]
    };
    instance_norm_2d: 17, F32 => |n| {
        let x = n.param("X", &[2, 3, 4, 2], -1.0, 1.0);
        let s = n.param("Scale", &[3], 0.5, 1.5);
        let b = n.param("Bias", &[3], -1.0, 1.0);
        vec![n.op("InstanceNormalization", &[x, s, b], vec![attr_float("epsilon", 1e-5)])]
    };
    instance_norm_1d: 17, F32 => |n| {
        let x = n.param("X", &[2, 3, 6], -1.0, 1.0);
        let s = n.param("Scale", &[3], 0.5, 1.5);
        let b = n.param("Bias", &[3], -1.0, 1.0);
        vec![n.op("InstanceNormalization", &[x, s, b], vec![])]
    };
    // Multi-output nodes where a later output reaches the loss (LayerNormalization's
    // statistics are float32 whatever X is, so these cases run in float32).
    layer_norm_only_mean: 17, F32 => |n| {
        // Scale and Bias do not reach the loss: constants here.
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let s = n.konst("Scale", &[4], &[0.9, 1.1, 1.2, 0.8]);
        let b = n.konst("Bias", &[4], &[0.1, -0.2, 0.3, 0.0]);
        let outs = n.node("LayerNormalization", &[Some(x), Some(s), Some(b)], 3, vec![attr_int("axis", -1)]);
        vec![outs[1]]
    };
    layer_norm_all_outputs_axis1: 17, F32 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let s = n.param("Scale", &[3, 4], 0.5, 1.5);
        let b = n.param("Bias", &[3, 4], -1.0, 1.0);
        let outs = n.node("LayerNormalization", &[Some(x), Some(s), Some(b)], 3,
            vec![attr_int("axis", 1), attr_float("epsilon", 1e-2)]);
        vec![outs[0], outs[1], outs[2]]
    };
    layer_norm_only_inv_std: 17, F32 => |n| {
        let x = n.param("X", &[3, 5], -1.0, 1.0);
        let s = n.konst("Scale", &[5], &[1.0; 5]);
        let b = n.konst("Bias", &[5], &[0.0; 5]);
        let outs = n.node("LayerNormalization", &[Some(x), Some(s), Some(b)], 3, vec![attr_float("epsilon", 1e-2)]);
        vec![outs[2]]
    };
    batch_norm: 17, F64 => |n| {
        let x = n.param("X", &[4, 3, 2, 2], -1.0, 1.0);
        let s = n.param("Scale", &[3], 0.5, 1.5);
        let b = n.param("Bias", &[3], -1.0, 1.0);
        let mean = n.random(&[3], -0.5, 0.5);
        let mean = n.tensor(&[3], &mean);
        let mean = n.model.add_initializer(MAIN, "running_mean", mean);
        let var = n.random(&[3], 0.5, 1.5);
        let var = n.tensor(&[3], &var);
        let var = n.model.add_initializer(MAIN, "running_var", var);
        vec![n.node("BatchNormalization", &[Some(x), Some(s), Some(b), Some(mean), Some(var)], 1,
            vec![attr_float("epsilon", 1e-5), attr_float("momentum", 0.9)])[0]]
    };

    // Statistics the graph computes (tf2onnx's Keras LayerNormalization): arithmetic on
    // them, differentiated through the statistics too.
    batch_norm_computed_statistics: 17, F64 => |n| {
        let x = n.param("X", &[4, 3, 2, 2], -1.0, 1.0);
        let s = n.param("Scale", &[3], 0.5, 1.5);
        let b = n.param("Bias", &[3], -1.0, 1.0);
        let m = n.param("Mean", &[3], -0.5, 0.5);
        let v = n.param("Var", &[3], 0.5, 1.5);
        let mean = n.op("Identity", &[m], vec![]);
        let var = n.op("Identity", &[v], vec![]);
        vec![n.node("BatchNormalization", &[Some(x), Some(s), Some(b), Some(mean), Some(var)], 1,
            vec![attr_float("epsilon", 1e-3)])[0]]
    };

    // ---- softmax
    softmax_last: 17, F64 => |n| unary(n, "Softmax", -2.0, 2.0, vec![]);
    softmax_axis1: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -2.0, 2.0);
        vec![n.op("Softmax", &[x], vec![attr_int("axis", 1)])]
    };
    log_softmax_last: 17, F64 => |n| unary(n, "LogSoftmax", -2.0, 2.0, vec![]);
    log_softmax_axis1: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -2.0, 2.0);
        vec![n.op("LogSoftmax", &[x], vec![attr_int("axis", 1)])]
    };

    // ---- reductions (opset 18: axes as an input)
    reduce_sum_keep0: 18, F64 => |n| reduce_case(n, "ReduceSum", 0);
    reduce_sum_keep1: 18, F64 => |n| reduce_case(n, "ReduceSum", 1);
    reduce_mean_keep0: 18, F64 => |n| reduce_case(n, "ReduceMean", 0);
    reduce_mean_keep1: 18, F64 => |n| reduce_case(n, "ReduceMean", 1);
    reduce_sum_square_keep0: 18, F64 => |n| reduce_case(n, "ReduceSumSquare", 0);
    reduce_sum_square_keep1: 18, F64 => |n| reduce_case(n, "ReduceSumSquare", 1);
    reduce_l2_keep0: 18, F64 => |n| reduce_case(n, "ReduceL2", 0);
    reduce_l2_keep1: 18, F64 => |n| reduce_case(n, "ReduceL2", 1);
    reduce_max_keep0: 18, F64 => |n| reduce_case(n, "ReduceMax", 0);
    reduce_max_keep1: 18, F64 => |n| reduce_case(n, "ReduceMax", 1);
    reduce_min_keep0: 18, F64 => |n| reduce_case(n, "ReduceMin", 0);
    reduce_min_keep1: 18, F64 => |n| reduce_case(n, "ReduceMin", 1);
    reduce_mean_opset17_axes_attr: 17, F64 => |n| {
        let x = n.param("X", &[3, 4, 2], -1.0, 1.0);
        vec![n.op("ReduceMean", &[x], vec![attr_ints("axes", &[0, 2]), attr_int("keepdims", 0)])]
    };
    reduce_sum_all_axes: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        vec![n.op("ReduceSum", &[x], vec![attr_int("keepdims", 1)])]
    };

    // ---- shape ops
    reshape: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let s = n.ints("shape", &[3], &[2, -1, 3]);
        vec![n.op("Reshape", &[x, s], vec![])]
    };
    flatten: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        vec![n.op("Flatten", &[x], vec![attr_int("axis", 2)])]
    };
    squeeze: 17, F64 => |n| {
        let x = n.param("X", &[3, 1, 4], -1.0, 1.0);
        let a = n.ints("axes", &[1], &[1]);
        vec![n.op("Squeeze", &[x, a], vec![])]
    };
    unsqueeze: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let a = n.ints("axes", &[2], &[0, 2]);
        vec![n.op("Unsqueeze", &[x, a], vec![])]
    };
    identity: 17, F64 => |n| unary(n, "Identity", -1.0, 1.0, vec![]);
    transpose: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        vec![n.op("Transpose", &[x], vec![attr_ints("perm", &[2, 0, 1])])]
    };
    transpose_default_perm: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        vec![n.op("Transpose", &[x], vec![])]
    };
    expand: 17, F64 => |n| {
        let x = n.param("X", &[3, 1], -1.0, 1.0);
        let s = n.ints("shape", &[3], &[2, 3, 4]);
        vec![n.op("Expand", &[x, s], vec![])]
    };
    concat: 17, F64 => |n| {
        let a = n.param("A", &[2, 3], -1.0, 1.0);
        let b = n.param("B", &[2, 2], -1.0, 1.0);
        vec![n.op("Concat", &[a, b], vec![attr_int("axis", -1)])]
    };
    split_unused_output: 17, F64 => |n| {
        let x = n.param("X", &[5, 3], -1.0, 1.0);
        let s = n.ints("split", &[3], &[1, 2, 2]);
        let outs = n.node("Split", &[Some(x), Some(s)], 3, vec![attr_int("axis", 0)]);
        vec![outs[0], outs[2]]
    };
    split_only_later_output: 17, F64 => |n| {
        // Only output 2 reaches the loss: outputs 0 and 1 get no gradient (zero rows).
        let x = n.param("X", &[5, 3], -1.0, 1.0);
        let s = n.ints("split", &[3], &[1, 2, 2]);
        let outs = n.node("Split", &[Some(x), Some(s)], 3, vec![attr_int("axis", 0)]);
        vec![outs[2]]
    };
    split_equal_opset18: 18, F64 => |n| {
        let x = n.param("X", &[2, 6], -1.0, 1.0);
        let outs = n.node("Split", &[Some(x)], 3, vec![attr_int("axis", 1), attr_int("num_outputs", 3)]);
        vec![outs[0], outs[1], outs[2]]
    };
    // Bounds computed at run time (GPT-NeoX's rotary half, `x[..., Shape(x)[-1] / 2:]`,
    // behind Casts that shape arithmetic does not follow): Pad(dY) by pads computed then.
    slice_bounds_at_run_time: 17, F64 => |n| {
        let x = n.param("X", &[3, 6], -1.0, 1.0);
        let half = half_of_width(n, x);
        let ends = n.ints("ends", &[1], &[i64::MAX]);
        let axes = n.ints("axes", &[1], &[1]);
        vec![n.op("Slice", &[x, half, ends, axes], vec![])]
    };
    slice_negative_bounds_at_run_time: 17, F64 => |n| {
        // starts [0, -3] (the second computed), ends [-1, -1]: rows 0..2, columns 3..5.
        let x = n.param("X", &[3, 6], -1.0, 1.0);
        let half = half_of_width(n, x);
        let from_end = n.op("Neg", &[half], vec![]);
        let first = n.ints("first_start", &[1], &[0]);
        let starts = n.op("Concat", &[first, from_end], vec![attr_int("axis", 0)]);
        let ends = n.ints("ends", &[2], &[-1, -1]);
        let axes = n.ints("axes", &[2], &[0, -1]);
        vec![n.op("Slice", &[x, starts, ends, axes], vec![])]
    };
    slice_int32_bounds_at_run_time: 17, F64 => |n| {
        let x = n.param("X", &[3, 6], -1.0, 1.0);
        let half = half_of_width(n, x);
        let starts = n.op("Cast", &[half], vec![attr_int("to", 6)]);
        let ends = n.int32s("ends", &[1], &[5]);
        let axes = n.int32s("axes", &[1], &[1]);
        vec![n.op("Slice", &[x, starts, ends, axes], vec![])]
    };
    // BERT's position embeddings through torch's TorchScript exporter: a [1, 6] id buffer
    // sliced to the sequence length (computed at run time), gathered from the table and
    // added to [N, T, H] embeddings: the table's gradient is summed over the batch.
    gather_of_a_sliced_buffer_broadcast_over_the_batch: 17, F64 => |n| {
        let x = n.param("X", &[2, 4, 3], -1.0, 1.0);
        let table = n.param("E", &[6, 3], -1.0, 1.0);
        let ids = n.ints("ids", &[1, 6], &[0, 1, 2, 3, 4, 5]);
        // The sequence length, 4, as a number the shape facts cannot know (the exporter's
        // went through float Casts, which the facts now follow).
        let end = unknown_to_the_facts(n, x, 4);
        let zero = n.ints("zero", &[1], &[0]);
        let axis = n.ints("axis", &[1], &[1]);
        let positions = n.op("Slice", &[ids, zero, end, axis], vec![]);
        let embedded = n.op("Gather", &[table, positions], vec![]);
        vec![n.op("Add", &[x, embedded], vec![])]
    };
    slice_unit_steps: 17, F64 => |n| {
        let x = n.param("X", &[3, 4, 5], -1.0, 1.0);
        let starts = n.ints("starts", &[2], &[1, -4]);
        let ends = n.ints("ends", &[2], &[3, 100]);
        let axes = n.ints("axes", &[2], &[0, -1]);
        vec![n.op("Slice", &[x, starts, ends, axes], vec![])]
    };
    slice_steps: 17, F64 => |n| {
        let x = n.param("X", &[4, 5], -1.0, 1.0);
        let starts = n.ints("starts", &[2], &[1, 0]);
        let ends = n.ints("ends", &[2], &[3, 5]);
        let axes = n.ints("axes", &[2], &[0, 1]);
        let steps = n.ints("steps", &[2], &[1, 2]);
        vec![n.op("Slice", &[x, starts, ends, axes, steps], vec![])]
    };
    slice_negative_step: 17, F64 => |n| {
        let x = n.param("X", &[4, 5], -1.0, 1.0);
        let starts = n.ints("starts", &[1], &[-1]);
        let ends = n.ints("ends", &[1], &[0]);
        let axes = n.ints("axes", &[1], &[1]);
        let steps = n.ints("steps", &[1], &[-2]);
        vec![n.op("Slice", &[x, starts, ends, axes, steps], vec![])]
    };
    slice_negative_steps_both_axes: 17, F64 => |n| {
        // Axis 0 reads 3, 2, 1; axis 1 reads 6, 3, 0.
        let x = n.param("X", &[4, 7], -1.0, 1.0);
        let starts = n.ints("starts", &[2], &[3, -1]);
        let ends = n.ints("ends", &[2], &[0, i64::MIN]);
        let axes = n.ints("axes", &[2], &[0, 1]);
        let steps = n.ints("steps", &[2], &[-1, -3]);
        vec![n.op("Slice", &[x, starts, ends, axes, steps], vec![])]
    };
    slice_mixed_steps_3d: 17, F64 => |n| {
        // Axis 0 unit step (rows 1, 2), axis 1 step 2 (0, 2), axis 2 step -2 from the end
        // past the start (5, 3, 1).
        let x = n.param("X", &[3, 4, 6], -1.0, 1.0);
        let starts = n.ints("starts", &[3], &[1, 0, 5]);
        let ends = n.ints("ends", &[3], &[3, 4, -100]);
        let axes = n.ints("axes", &[3], &[0, 1, 2]);
        let steps = n.ints("steps", &[3], &[1, 2, -2]);
        vec![n.op("Slice", &[x, starts, ends, axes, steps], vec![])]
    };
    pad_constant: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let pads = n.ints("pads", &[4], &[1, 0, 0, 2]);
        let value = n.konst("pad_value", &[], &[0.5]);
        let y = n.op("Pad", &[x, pads, value], vec![]);
        n.declare(y, &[4, 6]);
        vec![y]
    };
    pad_constant_undeclared: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let pads = n.ints("pads", &[4], &[1, 0, 0, 2]);
        let value = n.konst("pad_value", &[], &[0.5]);
        vec![n.op("Pad", &[x, pads, value], vec![])]
    };
    pad_axes_opset18: 18, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let pads = n.ints("pads", &[4], &[2, 1, 0, 1]);
        let axes = n.ints("axes", &[2], &[0, -1]);
        let y = n.node("Pad", &[Some(x), Some(pads), None, Some(axes)], 1, vec![])[0];
        n.declare(y, &[4, 3, 6]);
        vec![y]
    };
    // Pads that remove elements (negative) and pads computed at run time (Swin pads its maps
    // to a multiple of the window from their Shape): the gradient is Pad(dY, -pads).
    pad_negative: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let pads = n.ints("pads", &[4], &[1, -1, -1, 2]);
        let value = n.konst("pad_value", &[], &[0.5]);
        vec![n.op("Pad", &[x, pads, value], vec![])]
    };
    pad_negative_axes_opset18: 18, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let pads = n.ints("pads", &[4], &[-1, 1, 0, -2]);
        let axes = n.ints("axes", &[2], &[0, -1]);
        vec![n.node("Pad", &[Some(x), Some(pads), None, Some(axes)], 1, vec![])[0]]
    };
    pad_negative_attribute_opset10: 10, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        vec![n.op("Pad", &[x], vec![attr_ints("pads", &[0, 2, -1, -1])])]
    };
    pad_computed_from_shape: 17, F64 => |n| {
        // pads = [0, 0, 0, 4 - W % 4 ... ] as Swin computes them: (w - W % w) % w, w = 3.
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let shape = n.op("Shape", &[x], vec![]);
        let window = n.ints("window", &[2], &[3, 3]);
        let rest = n.op("Mod", &[shape, window], vec![]);
        let short = n.op("Sub", &[window, rest], vec![]);
        let to_window = n.op("Mod", &[short, window], vec![]);
        let zeros = n.ints("zeros", &[2], &[0, 0]);
        let pads = n.op("Concat", &[zeros, to_window], vec![attr_int("axis", 0)]);
        let value = n.konst("pad_value", &[], &[0.5]);
        vec![n.op("Pad", &[x, pads, value], vec![])]
    };
    tile: 17, F64 => |n| {
        let x = n.param("X", &[2, 3], -1.0, 1.0);
        let r = n.ints("repeats", &[2], &[2, 3]);
        let y = n.op("Tile", &[x, r], vec![]);
        n.declare(y, &[4, 9]);
        vec![y]
    };
    tile_undeclared: 17, F64 => |n| {
        let x = n.param("X", &[2, 3], -1.0, 1.0);
        let r = n.ints("repeats", &[2], &[2, 3]);
        vec![n.op("Tile", &[x, r], vec![])]
    };
    cast: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        vec![n.op("Cast", &[x], vec![attr_int("to", F64 as i64)])]
    };
    cast_like: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let like = n.konst("like", &[], &[0.0]);
        vec![n.op("CastLike", &[x, like], vec![])]
    };
    gather_axis0_repeated: 17, F64 => |n| {
        let x = n.param("X", &[5, 3], -1.0, 1.0);
        let i = n.ints("indices", &[4], &[0, 2, 2, 4]);
        vec![n.op("Gather", &[x, i], vec![attr_int("axis", 0)])]
    };
    gather_axis1_2d_negative: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let i = n.ints("indices", &[2, 2], &[-1, 0, 1, -1]);
        vec![n.op("Gather", &[x, i], vec![attr_int("axis", 1)])]
    };
    gather_axis1_1d: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let i = n.ints("indices", &[3], &[3, 0, 3]);
        vec![n.op("Gather", &[x, i], vec![attr_int("axis", 1)])]
    };
    gather_axis0_2d: 17, F64 => |n| {
        let x = n.param("X", &[4, 3], -1.0, 1.0);
        let i = n.ints("indices", &[2, 3], &[0, 1, 1, 3, -1, 0]);
        vec![n.op("Gather", &[x, i], vec![attr_int("axis", 0)])]
    };
    gather_axis1_scalar_index: 17, F64 => |n| {
        let x = n.param("X", &[2, 4, 3], -1.0, 1.0);
        let i = n.ints("index", &[], &[2]);
        vec![n.op("Gather", &[x, i], vec![attr_int("axis", -2)])]
    };
    gather_elements: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let i = n.ints("indices", &[3, 2], &[0, 0, 3, 1, 2, -1]);
        vec![n.op("GatherElements", &[x, i], vec![attr_int("axis", 1)])]
    };
    lp_normalization_p2_axis1: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        vec![n.op("LpNormalization", &[x], vec![attr_int("axis", 1), attr_int("p", 2)])]
    };
    lp_normalization_p1_axis0: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        vec![n.op("LpNormalization", &[x], vec![attr_int("axis", 0), attr_int("p", 1)])]
    };
    lp_normalization_default_3d: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        vec![n.op("LpNormalization", &[x], vec![])]
    };
    rms_norm_last_axis: 23, F64 => |n| {
        // stash_type 11: in float64 throughout (the default, 1, computes in float32).
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let s = n.param("Scale", &[4], 0.5, 1.5);
        vec![n.op("RMSNormalization", &[x, s], vec![attr_int("stash_type", 11)])]
    };
    rms_norm_axis1_broadcast_scale: 23, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let s = n.param("Scale", &[1, 4], 0.5, 1.5);
        vec![n.op("RMSNormalization", &[x, s], vec![
            attr_int("axis", 1), attr_float("epsilon", 1e-3), attr_int("stash_type", 11),
        ])]
    };
    rms_norm_f32_default_stash: 23, F32 => |n| {
        let x = n.param("X", &[3, 5], -1.0, 1.0);
        let s = n.param("Scale", &[5], 0.5, 1.5);
        vec![n.op("RMSNormalization", &[x, s], vec![])]
    };
    attention_causal_4d: 23, F64 => |n| {
        let (q, k, v) = attention_inputs(n, &[2, 2, 3, 4], &[2, 2, 3, 4], &[2, 2, 3, 4]);
        vec![n.op("Attention", &[q, k, v], vec![attr_int("is_causal", 1)])]
    };
    attention_grouped_3d_float_mask_scale: 23, F64 => |n| {
        // 4 query heads of size 2 over 2 key/value heads (values of size 3), 3 queries
        // against 5 keys, an additive mask, an explicit scale.
        let (q, k, v) = attention_inputs(n, &[2, 3, 8], &[2, 5, 4], &[2, 5, 6]);
        let mask = n.param("mask", &[3, 5], -0.5, 0.5);
        vec![n.op("Attention", &[q, k, v, mask], vec![
            attr_int("q_num_heads", 4), attr_int("kv_num_heads", 2), attr_float("scale", 0.3),
        ])]
    };
    attention_bool_mask_causal_softcap: 23, F64 => |n| {
        let (q, k, v) = attention_inputs(n, &[1, 2, 4, 3], &[1, 2, 4, 3], &[1, 2, 4, 3]);
        let keep: Vec<bool> = (0..16).map(|i| i != 5 && i != 10).collect();
        let mask = n.bools("mask", &[4, 4], &keep);
        vec![n.op("Attention", &[q, k, v, mask], vec![
            attr_int("is_causal", 1), attr_float("softcap", 2.0),
        ])]
    };
    attention_empty_row_is_zero: 23, F64 => |n| {
        // Query 0 may see key 0 only (causal), and the mask hides it: a row with no key,
        // which ONNX (1.23's errata) makes zero; ONNX Runtime 1.31's kernel still gives
        // NaN there, so the forward is not compared with it.
        let (q, k, v) = attention_inputs(n, &[1, 2, 4, 3], &[1, 2, 4, 3], &[1, 2, 4, 3]);
        let keep: Vec<bool> = (0..16).map(|i| i != 0 && i != 6).collect();
        let mask = n.bools("mask", &[4, 4], &keep);
        n.output_dims = Some(vec![vec![1, 2, 4, 3]]);
        vec![n.op("Attention", &[q, k, v, mask], vec![attr_int("is_causal", 1)])]
    };
    attention_f32_softmax_in_f64: 23, F32 => |n| {
        let (q, k, v) = attention_inputs(n, &[1, 3, 6], &[1, 3, 6], &[1, 3, 6]);
        // float32 differences of a causal softmax over at most 3 keys: 1.1e-3 measured
        // (the float64 cases hold the same arithmetic to 5e-8).
        n.tolerance = Some(2e-3);
        vec![n.op("Attention", &[q, k, v], vec![
            attr_int("q_num_heads", 2), attr_int("kv_num_heads", 2),
            attr_int("softmax_precision", 11), attr_int("is_causal", 1),
        ])]
    };
    mean_variance_norm_default_axes: 13, F32 => |n| {
        let x = n.param("X", &[2, 3, 2, 2], -1.0, 1.0);
        vec![n.op("MeanVarianceNormalization", &[x], vec![])]
    };
    mean_variance_norm_last_axis: 13, F32 => |n| {
        let x = n.param("X", &[3, 6], -1.0, 1.0);
        vec![n.op("MeanVarianceNormalization", &[x], vec![attr_ints("axes", &[-1])])]
    };
    gather_nd_elements: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let i = n.ints("indices", &[3, 2], &[0, 1, 2, 3, 0, 1]);
        vec![n.op("GatherND", &[x, i], vec![])]
    };
    gather_nd_slices: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let i = n.ints("indices", &[2, 1], &[2, 0]);
        vec![n.op("GatherND", &[x, i], vec![])]
    };
    scatter_elements_none: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let u = n.param("U", &[3, 2], -1.0, 1.0);
        let i = n.ints("indices", &[3, 2], &[0, 3, 1, 2, 3, 0]);
        vec![n.op("ScatterElements", &[x, i, u], vec![attr_int("axis", 1)])]
    };
    scatter_elements_add_repeated: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let u = n.param("U", &[2, 4], -1.0, 1.0);
        let i = n.ints("indices", &[2, 4], &[0, 2, 2, 1, 0, 0, 2, -1]);
        vec![n.op("ScatterElements", &[x, i, u],
            vec![attr_int("axis", 0), attr_string("reduction", "add")])]
    };
    scatter_nd_none: 17, F64 => |n| {
        let x = n.param("X", &[4, 3], -1.0, 1.0);
        let u = n.param("U", &[2, 3], -1.0, 1.0);
        let i = n.ints("indices", &[2, 1], &[1, 3]);
        vec![n.op("ScatterND", &[x, i, u], vec![])]
    };
    scatter_nd_add_repeated: 17, F64 => |n| {
        let x = n.param("X", &[4, 3], -1.0, 1.0);
        let u = n.param("U", &[3], -1.0, 1.0);
        let i = n.ints("indices", &[3, 2], &[1, 2, 3, 0, 1, 2]);
        vec![n.op("ScatterND", &[x, i, u], vec![attr_string("reduction", "add")])]
    };
    // max and min (opset 18): the gradient to the values equal to the result
    scatter_elements_max_repeated: 18, F64 => |n| scatter_elements_case(n, "max", 0, (&[3, 4], &[3, 4]), REPEATED_ROWS);
    scatter_elements_min: 18, F64 => |n| scatter_elements_case(n, "min", 1, (&[3, 4], &[3, 2]), &[0, 3, 1, 1, 3, 0]);
    scatter_nd_max_repeated: 18, F64 => |n| scatter_nd_case(n, "max", &[3, 3], (&[3, 1], &[1, 3, 1]));
    scatter_nd_min_elements: 18, F64 => |n| scatter_nd_case(n, "min", &[4], (&[4, 2], &[1, 2, 3, 0, 1, 2, 0, 0]));
    // Two-way ties, where a central difference gives each side half (the even split):
    // X[0, 0] = U[0, 0] and U[0, 1] = U[1, 1] both written at [1, 1] over a smaller X.
    scatter_elements_max_ties: 18, F64 => |n| {
        let x = n.param_with("X", &[2, 2], vec![0.5, -0.2, 0.1, 0.3]);
        let u = n.param_with("U", &[2, 2], vec![0.5, 0.7, -0.9, 0.7]);
        let i = n.ints("indices", &[2, 2], &[0, 1, 1, 1]);
        vec![n.op("ScatterElements", &[x, i, u],
            vec![attr_int("axis", 0), attr_string("reduction", "max")])]
    };
    scatter_elements_max: 18, F32 => |n| scatter_elements_case(n, "max", 0, (&[3, 4], &[3, 4]), REPEATED_ROWS);

    // ---- loss
    softmax_cross_entropy_ignore_index: 17, F64 => |n| {
        let x = n.param("X", &[5, 4], -2.0, 2.0);
        let labels = n.ints("labels", &[5], &[1, 3, 3, 0, 2]);
        vec![n.node("SoftmaxCrossEntropyLoss", &[Some(x), Some(labels)], 1,
            vec![attr_int("ignore_index", 3), attr_string("reduction", "mean")])[0]]
    };
    softmax_cross_entropy_sum_nd: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -2.0, 2.0);
        let labels = n.ints("labels", &[2, 4], &[0, 1, 2, 1, 2, -1, 0, 0]);
        vec![n.node("SoftmaxCrossEntropyLoss", &[Some(x), Some(labels)], 1,
            vec![attr_int("ignore_index", -1), attr_string("reduction", "sum")])[0]]
    };
    softmax_cross_entropy_none: 17, F64 => |n| {
        let x = n.param("X", &[4, 3], -2.0, 2.0);
        let labels = n.ints("labels", &[4], &[2, 0, 1, 1]);
        vec![n.node("SoftmaxCrossEntropyLoss", &[Some(x), Some(labels)], 1,
            vec![attr_string("reduction", "none")])[0]]
    };

    nll_mean: 17, F64 => |n| {
        let x = n.param("X", &[4, 3], -2.0, 0.0);
        let labels = n.ints("labels", &[4], &[2, 0, 1, 1]);
        vec![n.node("NegativeLogLikelihoodLoss", &[Some(x), Some(labels)], 1, vec![])[0]]
    };
    nll_weighted_ignore_index_nd: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -2.0, 0.0);
        let labels = n.ints("labels", &[2, 4], &[0, 2, -100, 1, 2, 2, 0, -100]);
        let w = n.konst("class_w", &[3], &[0.5, 2.0, 1.25]);
        vec![n.node("NegativeLogLikelihoodLoss", &[Some(x), Some(labels), Some(w)], 1,
            vec![attr_int("ignore_index", -100)])[0]]
    };
    nll_ignore_index_names_a_class_sum_int32: 17, F64 => |n| {
        let x = n.param("X", &[5, 4], -2.0, 0.0);
        let labels = n.int32s("labels", &[5], &[1, 3, 3, 0, 2]);
        vec![n.node("NegativeLogLikelihoodLoss", &[Some(x), Some(labels)], 1,
            vec![attr_int("ignore_index", 3), attr_string("reduction", "sum")])[0]]
    };
    nll_weighted_none: 17, F64 => |n| {
        let x = n.param("X", &[4, 3], -2.0, 0.0);
        let labels = n.ints("labels", &[4], &[2, 0, 1, 2]);
        let w = n.konst("class_w", &[3], &[0.25, 1.5, 3.0]);
        vec![n.node("NegativeLogLikelihoodLoss", &[Some(x), Some(labels), Some(w)], 1,
            vec![attr_string("reduction", "none")])[0]]
    };
    nll_of_log_softmax: 17, F64 => |n| {
        let s = n.param("S", &[4, 5], -2.0, 2.0);
        let lp = n.op("LogSoftmax", &[s], vec![attr_int("axis", 1)]);
        let labels = n.ints("labels", &[4], &[4, 0, 2, 2]);
        vec![n.node("NegativeLogLikelihoodLoss", &[Some(lp), Some(labels)], 1, vec![])[0]]
    };

    // Hardmax is piecewise constant: the gradient flows only through Mul's other input.
    hardmax_carries_no_gradient: 17, F32 => |n| {
        let x = n.param_distinct("X", &[3, 4], 0.5);
        let hard = n.op("Hardmax", &[x], vec![attr_int("axis", 1)]);
        vec![n.op("Mul", &[x, hard], vec![])]
    };

    // LRN: a large alpha so that the cross-channel term is not small beside the direct one.
    // ONNX Runtime's kernel takes only 4-D float32 inputs and odd sizes (the rule follows
    // ONNX's window for any size and rank; those are not run here).
    lrn_size5: 17, F32 => |n| {
        let x = n.param("X", &[2, 6, 3, 3], -2.0, 2.0);
        vec![n.op("LRN", &[x], vec![attr_int("size", 5), attr_float("alpha", 0.8),
            attr_float("beta", 0.75), attr_float("bias", 1.0)])]
    };
    lrn_size3_bias2: 17, F32 => |n| {
        let x = n.param("X", &[2, 5, 2, 3], -2.0, 2.0);
        vec![n.op("LRN", &[x], vec![attr_int("size", 3), attr_float("alpha", 1.5),
            attr_float("beta", 0.6), attr_float("bias", 2.0)])]
    };
    lrn_defaults: 17, F32 => |n| {
        let x = n.param("X", &[1, 7, 2, 2], -2.0, 2.0);
        vec![n.op("LRN", &[x], vec![attr_int("size", 3)])]
    };

    // GridSample: some points outside the image (zeros padding reads 0 there).
    grid_sample_linear_zeros: 20, F64 => |n| {
        let x = n.param("X", &[2, 2, 3, 4], -1.0, 1.0);
        let g = n.param("G", &[2, 3, 2, 2], -1.15, 1.15);
        vec![n.op("GridSample", &[x, g], vec![attr_string("mode", "linear")])]
    };
    grid_sample_bilinear_border_align_corners_opset16: 16, F32 => |n| {
        let x = n.param("X", &[1, 3, 4, 3], -1.0, 1.0);
        let g = n.param("G", &[1, 2, 4, 2], -1.2, 1.2);
        vec![n.op("GridSample", &[x, g], vec![attr_string("mode", "bilinear"),
            attr_string("padding_mode", "border"), attr_int("align_corners", 1)])]
    };
    grid_sample_linear_zeros_align_corners: 20, F64 => |n| {
        let x = n.param("X", &[1, 2, 3, 3], -1.0, 1.0);
        let g = n.param("G", &[1, 4, 3, 2], -1.1, 1.1);
        vec![n.op("GridSample", &[x, g], vec![attr_int("align_corners", 1)])]
    };
    // nearest: the grid is a constant (the output is piecewise constant in it).
    grid_sample_nearest: 20, F64 => |n| {
        let x = n.param("X", &[2, 2, 3, 4], -1.0, 1.0);
        let g = n.konst("grid", &[2, 3, 2, 2], &[
            -0.9, -0.7, 0.3, 0.55, 0.8, -0.1, 1.3, 0.2, -0.45, 0.9, 0.05, -0.6,
            0.6, 0.35, -0.2, -0.95, 0.15, 0.7, -1.4, 0.4, 0.95, 0.1, -0.3, -0.25]);
        vec![n.op("GridSample", &[x, g], vec![attr_string("mode", "nearest")])]
    };

    // ---- a parameter shared by two nodes: its gradient is the sum
    shared_parameter: 17, F64 => |n| {
        let x = n.param("X", &[2, 3], -1.0, 1.0);
        let w = n.param("W", &[3, 3], -1.0, 1.0);
        let y1 = n.op("MatMul", &[x, w], vec![]);
        let y2 = n.op("Tanh", &[w], vec![]);
        vec![y1, y2]
    };
    shared_parameter_same_node: 17, F64 => |n| {
        let w = n.param("W", &[3, 4], -1.0, 1.0);
        vec![n.op("Mul", &[w, w], vec![])]
    };
}

cases! {
    // ---- trigonometric and hyperbolic
    sin: 17, F64 => |n| unary(n, "Sin", -2.0, 2.0, vec![]);
    cos: 17, F64 => |n| unary(n, "Cos", -2.0, 2.0, vec![]);
    tan: 17, F32 => |n| unary(n, "Tan", -1.2, 1.2, vec![]);
    asin: 17, F32 => |n| unary(n, "Asin", -0.8, 0.8, vec![]);
    acos: 17, F32 => |n| unary(n, "Acos", -0.8, 0.8, vec![]);
    atan: 17, F32 => |n| unary(n, "Atan", -2.0, 2.0, vec![]);
    sinh: 17, F32 => |n| unary(n, "Sinh", -1.5, 1.5, vec![]);
    cosh: 17, F32 => |n| unary(n, "Cosh", -1.5, 1.5, vec![]);
    asinh: 17, F32 => |n| unary(n, "Asinh", -2.0, 2.0, vec![]);
    acosh: 17, F32 => |n| unary(n, "Acosh", 1.2, 3.0, vec![]);
    atanh: 17, F32 => |n| unary(n, "Atanh", -0.8, 0.8, vec![]);

    // ---- more activations
    softsign: 17, F32 => |n| unary(n, "Softsign", -2.0, 2.0, vec![]);
    selu: 17, F32 => |n| unary_avoid(n, "Selu", -1.5, 1.5, &[0.0], vec![]);
    selu_attrs: 17, F32 => |n| unary_avoid(n, "Selu", -1.5, 1.5, &[0.0],
        vec![attr_float("alpha", 0.6), attr_float("gamma", 1.3)]);
    celu: 17, F32 => |n| unary_avoid(n, "Celu", -1.5, 1.5, &[0.0], vec![attr_float("alpha", 0.8)]);
    thresholded_relu: 17, F32 => |n| unary_avoid(n, "ThresholdedRelu", -1.5, 1.5, &[0.3],
        vec![attr_float("alpha", 0.3)]);
    shrink: 17, F32 => |n| unary_avoid(n, "Shrink", -1.5, 1.5, &[-0.4, 0.4],
        vec![attr_float("lambd", 0.4), attr_float("bias", 0.1)]);
    mish: 18, F32 => |n| unary(n, "Mish", -2.0, 2.0, vec![]);
    swish: 24, F64 => |n| unary(n, "Swish", -2.0, 2.0, vec![attr_float("alpha", 0.7)]);
    swish_default_alpha: 24, F64 => |n| unary(n, "Swish", -2.0, 2.0, vec![]);
    prelu_channel_slope: 17, F32 => |n| {
        let x = n.param_avoid("X", &[2, 3, 4], -1.5, 1.5, &[0.0], 0.05);
        let slope = n.param("slope", &[3, 1], 0.05, 0.5);
        vec![n.op("PRelu", &[x, slope], vec![])]
    };
    prelu_one_slope: 17, F32 => |n| {
        let x = n.param_avoid("X", &[3, 4], -1.5, 1.5, &[0.0], 0.05);
        let slope = n.param("slope", &[1], 0.05, 0.5);
        vec![n.op("PRelu", &[x, slope], vec![])]
    };

    // ---- fmod: A/B kept away from whole numbers, where fmod jumps
    fmod: 17, F64 => |n| {
        let b: Vec<f64> = (0..12)
            .map(|i| n.rng.uniform(0.7, 1.6) * if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        let a: Vec<f64> = b
            .iter()
            .map(|b| {
                let whole = (n.rng.next() % 5) as f64 - 2.0;
                b * (whole + n.rng.uniform(0.2, 0.8))
            })
            .collect();
        let a = n.param_with("A", &[3, 4], a);
        let b = n.param_with("B", &[3, 4], b);
        vec![n.op("Mod", &[a, b], vec![attr_int("fmod", 1)])]
    };

    // ---- more reductions
    reduce_log_sum_keep0: 18, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], 0.5, 2.0);
        let axes = n.ints("axes", &[2], &[0, 2]);
        vec![n.op("ReduceLogSum", &[x, axes], vec![attr_int("keepdims", 0)])]
    };
    reduce_log_sum_all_opset17: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], 0.5, 2.0);
        vec![n.op("ReduceLogSum", &[x], vec![])]
    };
    reduce_log_sum_exp_keep0: 18, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -2.0, 2.0);
        let axes = n.ints("axes", &[2], &[0, 2]);
        vec![n.op("ReduceLogSumExp", &[x, axes], vec![attr_int("keepdims", 0)])]
    };
    reduce_log_sum_exp_keep1: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -2.0, 2.0);
        vec![n.op("ReduceLogSumExp", &[x], vec![attr_ints("axes", &[-1])])]
    };
    reduce_prod_keep0: 18, F64 => |n| reduce_case(n, "ReduceProd", 0);
    reduce_prod_keep1: 18, F64 => |n| reduce_case(n, "ReduceProd", 1);
    // Rows with no zero, one zero and two zeros: the product of the others, never X's
    // reciprocal (the one zero gets the product of its row's other elements).
    reduce_prod_zeros: 18, F64 => |n| {
        let x = n.param_with("X", &[3, 4], vec![
            0.5, -1.2, 0.8, 1.1,
            0.7, 0.0, -0.9, 1.3,
            0.0, 0.6, 0.0, -1.4,
        ]);
        let axes = n.ints("axes", &[1], &[1]);
        vec![n.op("ReduceProd", &[x, axes], vec![attr_int("keepdims", 0)])]
    };
    reduce_prod_all_opset17: 17, F64 => |n| {
        let x = n.param("X", &[2, 3], 0.5, 1.5);
        vec![n.op("ReduceProd", &[x], vec![attr_int("keepdims", 0)])]
    };
    reduce_l1_keep0: 18, F64 => |n| {
        let x = n.param_avoid("X", &[2, 3, 4], -2.0, 2.0, &[0.0], 0.05);
        let axes = n.ints("axes", &[1], &[1]);
        vec![n.op("ReduceL1", &[x, axes], vec![attr_int("keepdims", 0)])]
    };
    global_max_pool: 17, F32 => |n| {
        let x = n.param_distinct("X", &[2, 3, 2, 3], 0.1);
        vec![n.op("GlobalMaxPool", &[x], vec![])]
    };

    // ---- more data movement
    top_k_largest: 17, F64 => |n| {
        let x = n.param_distinct("X", &[3, 5], 0.1);
        let k = n.ints("k", &[1], &[2]);
        vec![n.node("TopK", &[Some(x), Some(k)], 2, vec![])[0]]
    };
    top_k_smallest_axis0: 17, F64 => |n| {
        let x = n.param_distinct("X", &[4, 3], 0.1);
        let k = n.ints("k", &[1], &[3]);
        vec![n.node("TopK", &[Some(x), Some(k)], 2,
            vec![attr_int("axis", 0), attr_int("largest", 0)])[0]]
    };
    trilu_upper_k1: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let k = n.ints("k", &[], &[1]);
        vec![n.op("Trilu", &[x, k], vec![])]
    };
    trilu_lower: 17, F64 => |n| {
        let x = n.param("X", &[4, 3], -1.0, 1.0);
        vec![n.op("Trilu", &[x], vec![attr_int("upper", 0)])]
    };
    // Each batch column's first lens[b] steps reversed (the rest stay): tf2onnx's
    // Bidirectional backward layer.
    reverse_sequence: 17, F64 => |n| {
        let x = n.param("X", &[4, 3, 2], -1.0, 1.0);
        let lens = n.ints("lens", &[3], &[4, 2, 3]);
        vec![n.op("ReverseSequence", &[x, lens],
            vec![attr_int("batch_axis", 1), attr_int("time_axis", 0)])]
    };
    cum_sum: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let axis = n.ints("axis", &[], &[1]);
        vec![n.op("CumSum", &[x, axis], vec![])]
    };
    cum_sum_exclusive_reverse: 17, F64 => |n| {
        let x = n.param("X", &[3, 4], -1.0, 1.0);
        let axis = n.ints("axis", &[], &[0]);
        vec![n.op("CumSum", &[x, axis], vec![attr_int("exclusive", 1), attr_int("reverse", 1)])]
    };
    depth_to_space_dcr: 17, F64 => |n| {
        let x = n.param("X", &[2, 8, 2, 3], -1.0, 1.0);
        vec![n.op("DepthToSpace", &[x], vec![attr_int("blocksize", 2)])]
    };
    depth_to_space_crd: 17, F64 => |n| {
        let x = n.param("X", &[2, 8, 2, 3], -1.0, 1.0);
        vec![n.op("DepthToSpace", &[x], vec![attr_int("blocksize", 2), attr_string("mode", "CRD")])]
    };
    space_to_depth: 17, F64 => |n| {
        let x = n.param("X", &[2, 2, 4, 6], -1.0, 1.0);
        vec![n.op("SpaceToDepth", &[x], vec![attr_int("blocksize", 2)])]
    };
}

fn einsum_case(n: &mut Net, equation: &str, dims: &[&[i64]]) -> Vec<ValueId> {
    let names = ["A", "B", "C"];
    let inputs: Vec<ValueId> = dims
        .iter()
        .zip(names)
        .map(|(d, name)| n.param(name, d, -1.0, 1.0))
        .collect();
    vec![n.op("Einsum", &inputs, vec![attr_string("equation", equation)])]
}

cases! {
    // ---- einsum
    einsum_matmul: 12, F64 => |n| einsum_case(n, "ij,jk->ik", &[&[3, 4], &[4, 5]]);
    einsum_implicit_output: 12, F64 => |n| einsum_case(n, "jk,ij", &[&[4, 5], &[3, 4]]);
    einsum_attention_scores: 12, F64 => |n| einsum_case(n, "bhid, bhjd -> bhij", &[&[2, 2, 3, 4], &[2, 2, 5, 4]]);
    einsum_three_operands: 12, F64 => |n| einsum_case(n, "ij,jk,kl->il", &[&[2, 3], &[3, 4], &[4, 2]]);
    einsum_sum_all: 12, F64 => |n| einsum_case(n, "ij->", &[&[3, 4]]);
    einsum_outer: 12, F64 => |n| einsum_case(n, "i,j->ij", &[&[3], &[4]]);
    einsum_transpose: 12, F64 => |n| einsum_case(n, "ijk->kij", &[&[2, 3, 4]]);
    einsum_summed_in_one_input: 12, F64 => |n| einsum_case(n, "ikj,jl->il", &[&[3, 2, 4], &[4, 5]]);
    einsum_ellipsis: 12, F64 => |n| einsum_case(n, "...ij,...jk->...ik", &[&[2, 3, 4], &[2, 4, 5]]);
    einsum_ellipsis_broadcast_one: 12, F64 => |n| einsum_case(n, "...ij,...jk->...ik", &[&[2, 3, 4], &[1, 4, 5]]);
    einsum_ellipsis_inside: 12, F64 => |n| einsum_case(n, "i...k,k->...i", &[&[3, 2, 4], &[4]]);
    einsum_ellipsis_two_axes_one_side: 12, F64 => |n| einsum_case(n, "...ij,jk->...ik", &[&[2, 2, 3, 4], &[4, 5]]);
}

#[test]
fn einsum_diagonal_is_refused() {
    check_error("einsum_diagonal_is_refused", 12, F64, "diagonal", |n| {
        einsum_case(n, "ii->i", &[&[3, 3]])
    });
}

/// `ScatterElements(X, indices, U)` along `axis` with `reduction`, X and U parameters.
fn scatter_elements_case(
    n: &mut Net,
    reduction: &str,
    axis: i64,
    (x_dims, u_dims): (&[i64], &[i64]),
    indices: &[i64],
) -> Vec<ValueId> {
    let x = n.param("X", x_dims, -1.0, 1.0);
    let u = n.param("U", u_dims, -1.5, 1.5);
    let i = n.ints("indices", u_dims, indices);
    let attrs = vec![attr_int("axis", axis), attr_string("reduction", reduction)];
    vec![n.op("ScatterElements", &[x, i, u], attrs)]
}

/// `ScatterND(X, indices, U)` with `reduction`, X [4, 3] and U parameters.
fn scatter_nd_case(
    n: &mut Net,
    reduction: &str,
    u_dims: &[i64],
    (i_dims, indices): (&[i64], &[i64]),
) -> Vec<ValueId> {
    let x = n.param("X", &[4, 3], -1.0, 1.0);
    let u = n.param("U", u_dims, -1.5, 1.5);
    let i = n.ints("indices", i_dims, indices);
    vec![n.op(
        "ScatterND",
        &[x, i, u],
        vec![attr_string("reduction", reduction)],
    )]
}

#[test]
fn scatter_with_an_unknown_reduction_is_refused() {
    check_error(
        "scatter_prod_is_refused",
        18,
        F64,
        "reduction 'prod'",
        |n| {
            let x = n.param("X", &[3, 4], -1.0, 1.0);
            let u = n.param("U", &[1, 4], -1.0, 1.0);
            let i = n.ints("indices", &[1, 4], &[0, 1, 2, 0]);
            vec![n.op(
                "ScatterElements",
                &[x, i, u],
                vec![attr_string("reduction", "prod")],
            )]
        },
    );
}

cases! {
    // ---- scatters that multiply (opset 18): no division by an update that may be zero
    scatter_elements_mul_repeated_f64: 18, F64 => |n| scatter_elements_case(n, "mul", 0, (&[3, 4], &[3, 4]), REPEATED_ROWS);
    scatter_nd_mul_repeated_f64: 18, F64 => |n| scatter_nd_case(n, "mul", &[3, 3], (&[3, 1], &[1, 3, 1]));
    // Zero updates: at [0, 0] one zero beside a non-zero update (the zero's gradient is the
    // others' product, the other's 0), at [0, 1] two zeros (both 0), at [1, 2] none.
    scatter_elements_mul_zeros_f64: 18, F64 => |n| {
        let x = n.param("X", &[2, 3], -1.0, 1.0);
        let u = n.param_with("U", &[2, 3], vec![0.0, 0.0, 0.7, -1.3, 0.0, 1.1]);
        let i = n.ints("indices", &[2, 3], &[0, 0, 1, 0, 0, 1]);
        vec![n.op("ScatterElements", &[x, i, u],
            vec![attr_int("axis", 0), attr_string("reduction", "mul")])]
    };
    scatter_elements_mul: 18, F32 => |n| scatter_elements_case(n, "mul", 0, (&[3, 4], &[3, 4]), REPEATED_ROWS);
}

cases! {
    // ---- GatherND with batch_dims: the batch positions written in front of each tuple
    gather_nd_batch_dims_1_f64: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        // a repeated tuple in the first batch: its gradient adds up
        let i = n.ints("indices", &[2, 2, 1], &[2, 2, 0, 1]);
        vec![n.op("GatherND", &[x, i], vec![attr_int("batch_dims", 1)])]
    };
    gather_nd_batch_dims_1_pairs_f64: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let i = n.ints("indices", &[2, 3, 2], &[0, 3, 2, 1, 0, 3, 1, 1, 1, 1, 2, 0]);
        vec![n.op("GatherND", &[x, i], vec![attr_int("batch_dims", 1)])]
    };
    gather_nd_batch_dims_2_f64: 17, F64 => |n| {
        let x = n.param("X", &[2, 3, 4, 5], -1.0, 1.0);
        let i = n.ints("indices", &[2, 3, 2, 1], &[3, 0, 1, 1, 2, 3, 0, 0, 3, 2, 1, 2]);
        vec![n.op("GatherND", &[x, i], vec![attr_int("batch_dims", 2)])]
    };
    gather_nd_batch_dims_1: 17, F32 => |n| {
        let x = n.param("X", &[2, 3, 4], -1.0, 1.0);
        let i = n.ints("indices", &[2, 2, 1], &[2, 2, 0, 1]);
        vec![n.op("GatherND", &[x, i], vec![attr_int("batch_dims", 1)])]
    };
}

/// Resize of a `dims` parameter by constant `scales` (or `sizes`), roi empty.
fn resize_case(
    n: &mut Net,
    dims: &[i64],
    scales: Option<&[f64]>,
    sizes: Option<&[i64]>,
    attrs: Vec<AttributeProto>,
) -> Vec<ValueId> {
    let x = n.param("X", dims, -1.0, 1.0);
    let scales = scales.map(|s| n.konst("scales", &[s.len() as i64], s));
    let sizes = sizes.map(|s| n.ints("sizes", &[s.len() as i64], s));
    vec![n.node("Resize", &[Some(x), None, scales, sizes], 1, attrs)[0]]
}

fn mode(m: &str) -> AttributeProto {
    attr_string("mode", m)
}

fn transform(t: &str) -> AttributeProto {
    attr_string("coordinate_transformation_mode", t)
}

cases! {
    // ---- resize: nearest by a whole factor (summed blocks), the rest (a matrix)
    resize_nearest_2x: 13, F32 => |n| resize_case(n, &[1, 2, 3, 4], Some(&[1.0, 1.0, 2.0, 2.0]), None, vec![]);
    resize_nearest_torch_upsample: 13, F32 => |n| resize_case(n, &[2, 2, 3, 3], Some(&[1.0, 1.0, 2.0, 3.0]), None,
        vec![mode("nearest"), transform("asymmetric"), attr_string("nearest_mode", "floor")]);
    resize_nearest_1_5x: 13, F32 => |n| resize_case(n, &[1, 2, 4, 4], Some(&[1.0, 1.0, 1.5, 1.5]), None, vec![]);
    // What tf2onnx writes for Keras's UpSampling2D (a mode ONNX dropped at opset 13).
    resize_nearest_tf_half_pixel: 13, F32 => |n| resize_case(n, &[1, 2, 4, 4], Some(&[1.0, 1.0, 1.5, 2.0]), None,
        vec![transform("tf_half_pixel_for_nn")]);
    resize_nearest_sizes_prefer_ceil: 13, F32 => |n| resize_case(n, &[1, 1, 3, 5], None, Some(&[1, 1, 7, 4]),
        vec![attr_string("nearest_mode", "round_prefer_ceil"), transform("align_corners")]);
    resize_linear_half_pixel_2x: 13, F32 => |n| resize_case(n, &[1, 2, 3, 4], Some(&[1.0, 1.0, 2.0, 2.0]), None,
        vec![mode("linear")]);
    resize_linear_pytorch_half_pixel: 13, F32 => |n| resize_case(n, &[1, 2, 3, 4], Some(&[1.0, 1.0, 2.0, 2.0]), None,
        vec![mode("linear"), transform("pytorch_half_pixel")]);
    resize_linear_align_corners_sizes: 13, F32 => |n| resize_case(n, &[1, 2, 3, 4], None, Some(&[1, 2, 5, 9]),
        vec![mode("linear"), transform("align_corners")]);
    resize_linear_downsample: 13, F32 => |n| resize_case(n, &[1, 2, 6, 5], Some(&[1.0, 1.0, 0.5, 0.6]), None,
        vec![mode("linear")]);
    resize_linear_asymmetric_1d: 13, F32 => |n| resize_case(n, &[2, 3, 4], Some(&[1.0, 1.0, 2.5]), None,
        vec![mode("linear"), transform("asymmetric")]);
    resize_linear_middle_axis: 13, F32 => |n| resize_case(n, &[2, 3, 4], Some(&[1.0, 2.0, 1.0]), None,
        vec![mode("linear")]);
    resize_cubic: 13, F32 => |n| resize_case(n, &[1, 1, 4, 5], Some(&[1.0, 1.0, 2.0, 1.6]), None,
        vec![mode("cubic")]);
    resize_cubic_exclude_outside: 13, F32 => |n| resize_case(n, &[1, 1, 4, 5], Some(&[1.0, 1.0, 1.5, 2.0]), None,
        vec![mode("cubic"), attr_float("cubic_coeff_a", -0.5), attr_int("exclude_outside", 1)]);
    resize_linear_axes_opset18: 18, F32 => |n| resize_case(n, &[1, 2, 3, 4], Some(&[2.0, 1.5]), None,
        vec![mode("linear"), attr_ints("axes", &[2, 3])]);
    resize_linear_half_pixel_symmetric: 19, F32 => |n| resize_case(n, &[1, 1, 3, 4], Some(&[1.0, 1.0, 1.7, 2.3]), None,
        vec![mode("linear"), transform("half_pixel_symmetric")]);
    // MobileViT's `interpolate(size=...)`: sizes `Shape(X)[0:2] ++ [H, W]`, computed.
    resize_linear_sizes_from_shape: 19, F32 => |n| {
        let x = n.param("X", &[2, 2, 3, 4], -1.0, 1.0);
        let lead = n.op("Shape", &[x], vec![attr_int("end", 2)]);
        let hw = n.ints("hw", &[2], &[5, 7]);
        let sizes = n.op("Concat", &[lead, hw], vec![attr_int("axis", 0)]);
        vec![n.node("Resize", &[Some(x), None, None, Some(sizes)], 1, vec![mode("linear")])[0]]
    };
}

/// A kernel whose constants would not fit (5000 x 5000 over the padded input's one window):
/// refused by name before anything is allocated.
#[test]
fn average_pool_too_large_a_kernel_is_refused() {
    check_error(
        "average_pool_too_large_a_kernel_is_refused",
        19,
        F32,
        "more than 16777216",
        |n| {
            let x = n.param("X", &[1, 1, 4, 4], -1.0, 1.0);
            vec![n.op(
                "AveragePool",
                &[x],
                vec![
                    attr_ints("kernel_shape", &[5000, 5000]),
                    attr_ints("strides", &[1, 1]),
                    attr_ints("pads", &[0, 0, 4996, 4996]),
                ],
            )]
        },
    );
}

#[test]
fn resize_crop_and_resize_is_refused() {
    check_error(
        "resize_crop_and_resize_is_refused",
        13,
        F32,
        "tf_crop_and_resize",
        |n| {
            resize_case(
                n,
                &[1, 1, 3, 4],
                Some(&[1.0, 1.0, 2.0, 2.0]),
                None,
                vec![transform("tf_crop_and_resize")],
            )
        },
    );
}

/// A recurrent layer (`op`: LSTM, GRU or RNN; `gates` 4, 3, 1): S 3, N 2, I 4, H 3.
/// Optional inputs as asked; every output reaches the loss. ONNX Runtime has no float64
/// recurrent kernels: a float64 case gives the output dims and is not run as a forward; the
/// float32 cases compare ONNX Runtime's kernels with the unrolled forward (1e-5).
#[allow(clippy::too_many_arguments)]
fn recurrent_case(
    n: &mut Net,
    op: &str,
    gates: i64,
    dirs: i64,
    bias: bool,
    initial: bool,
    peepholes: bool,
    mut attrs: Vec<AttributeProto>,
) -> Vec<ValueId> {
    let (s, b, i, h) = (3, 2, 4, 3);
    let (x_dims, state_dims) = ([s, b, i], [dirs, b, h]);
    let x = n.param("X", &x_dims, -1.0, 1.0);
    let w = n.param("W", &[dirs, gates * h, i], -0.6, 0.6);
    let r = n.param("R", &[dirs, gates * h, h], -0.6, 0.6);
    let bias = bias.then(|| n.param("B", &[dirs, 2 * gates * h], -0.5, 0.5));
    let h0 = initial.then(|| n.param("initial_h", &state_dims, -0.5, 0.5));
    let c0 = (initial && op == "LSTM").then(|| n.param("initial_c", &state_dims, -0.5, 0.5));
    let p = peepholes.then(|| n.param("P", &[dirs, 3 * h], -0.5, 0.5));
    attrs.push(attr_int("hidden_size", h));
    if dirs == 2 {
        attrs.push(attr_string("direction", "bidirectional"));
    }
    let mut inputs = vec![Some(x), Some(w), Some(r), bias, None, h0];
    if op == "LSTM" {
        inputs.extend([c0, p]);
    }
    let outputs = if op == "LSTM" { 3 } else { 2 };
    if n.elem == F32 {
        // Three cells of small recurrent gradients (|fd| ~0.1): float32 differences measure
        // them to 1-2.3e-3; the float64 twin holds them to 1e-6.
        n.tolerance = Some(5e-3);
    }
    if n.elem == F64 {
        let y = vec![s, dirs, b, h];
        let state = vec![dirs, b, h];
        let mut dims = vec![y, state.clone()];
        if op == "LSTM" {
            dims.push(state);
        }
        n.output_dims = Some(dims);
    }
    n.node(op, &inputs, outputs, attrs)
}

cases! {
    // ---- recurrent layers, unrolled: float32 against ONNX Runtime's kernels (the forward),
    // float64 for the gradients
    lstm_full: 14, F32 => |n| recurrent_case(n, "LSTM", 4, 1, true, true, true, vec![]);
    lstm_full_f64: 14, F64 => |n| recurrent_case(n, "LSTM", 4, 1, true, true, true, vec![]);
    lstm_plain: 14, F32 => |n| recurrent_case(n, "LSTM", 4, 1, false, false, false, vec![]);
    lstm_plain_f64: 14, F64 => |n| recurrent_case(n, "LSTM", 4, 1, false, false, false, vec![]);
    lstm_bidirectional: 14, F32 => |n| recurrent_case(n, "LSTM", 4, 2, true, true, false, vec![]);
    lstm_bidirectional_f64: 14, F64 => |n| recurrent_case(n, "LSTM", 4, 2, true, true, false, vec![]);
    lstm_reverse: 14, F32 => |n| recurrent_case(n, "LSTM", 4, 1, true, false, true,
        vec![attr_string("direction", "reverse")]);
    lstm_reverse_f64: 14, F64 => |n| recurrent_case(n, "LSTM", 4, 1, true, false, true,
        vec![attr_string("direction", "reverse")]);
    gru_linear_before_reset: 14, F32 => |n| recurrent_case(n, "GRU", 3, 1, true, true, false,
        vec![attr_int("linear_before_reset", 1)]);
    gru_linear_before_reset_f64: 14, F64 => |n| recurrent_case(n, "GRU", 3, 1, true, true, false,
        vec![attr_int("linear_before_reset", 1)]);
    gru_linear_before_reset_zero_state: 14, F32 => |n| recurrent_case(n, "GRU", 3, 1, true, false, false,
        vec![attr_int("linear_before_reset", 1)]);
    gru_linear_before_reset_zero_state_f64: 14, F64 => |n| recurrent_case(n, "GRU", 3, 1, true, false, false,
        vec![attr_int("linear_before_reset", 1)]);
    gru_bidirectional: 14, F32 => |n| recurrent_case(n, "GRU", 3, 2, true, false, false, vec![]);
    gru_bidirectional_f64: 14, F64 => |n| recurrent_case(n, "GRU", 3, 2, true, false, false, vec![]);
    gru_no_bias_initial_state: 14, F32 => |n| recurrent_case(n, "GRU", 3, 1, false, true, false, vec![]);
    gru_no_bias_initial_state_f64: 14, F64 => |n| recurrent_case(n, "GRU", 3, 1, false, true, false, vec![]);
    rnn_tanh: 14, F32 => |n| recurrent_case(n, "RNN", 1, 1, true, true, false, vec![]);
    rnn_tanh_f64: 14, F64 => |n| recurrent_case(n, "RNN", 1, 1, true, true, false, vec![]);
    rnn_sigmoid_bidirectional: 14, F32 => |n| recurrent_case(n, "RNN", 1, 2, true, false, false,
        vec![attr_strings("activations", &["Sigmoid", "Tanh"])]);
    rnn_sigmoid_bidirectional_f64: 14, F64 => |n| recurrent_case(n, "RNN", 1, 2, true, false, false,
        vec![attr_strings("activations", &["Sigmoid", "Tanh"])]);
}

/// A recurrent case with the layer as Loops (`loops=keep`: one per direction, the cell in
/// the body, differentiated by `loop_grad`) instead of unrolled cells.
fn kept(n: &mut Net) -> &mut Net {
    n.pipeline = PIPELINE_LOOPS_KEPT;
    n
}

cases! {
    // ---- recurrent layers as Loops (opset 16 on: a step's gradient is a scatter that adds):
    // float32 against ONNX Runtime's kernels, float64 for the gradients
    lstm_full_as_loop: 17, F32 => |n| recurrent_case(kept(n), "LSTM", 4, 1, true, true, true, vec![]);
    lstm_full_as_loop_f64: 17, F64 => |n| recurrent_case(kept(n), "LSTM", 4, 1, true, true, true, vec![]);
    lstm_plain_as_loop_f64: 17, F64 => |n| recurrent_case(kept(n), "LSTM", 4, 1, false, false, false, vec![]);
    lstm_bidirectional_as_loop: 17, F32 => |n| recurrent_case(kept(n), "LSTM", 4, 2, true, true, false, vec![]);
    lstm_bidirectional_as_loop_f64: 17, F64 => |n| recurrent_case(kept(n), "LSTM", 4, 2, true, true, false, vec![]);
    gru_linear_before_reset_zero_state_as_loop_f64: 17, F64 => |n| recurrent_case(kept(n), "GRU", 3, 1, true, false, false,
        vec![attr_int("linear_before_reset", 1)]);
    gru_bidirectional_as_loop: 17, F32 => |n| recurrent_case(kept(n), "GRU", 3, 2, true, false, false, vec![]);
    gru_bidirectional_as_loop_f64: 17, F64 => |n| recurrent_case(kept(n), "GRU", 3, 2, true, false, false, vec![]);
    rnn_sigmoid_bidirectional_as_loop_f64: 17, F64 => |n| recurrent_case(kept(n), "RNN", 1, 2, true, false, false,
        vec![attr_strings("activations", &["Sigmoid", "Tanh"])]);
}

/// A Loop node with `inputs` and `outputs` outputs, and its body, empty (to be filled).
fn loop_node(n: &mut Net, inputs: &[Option<ValueId>], outputs: usize) -> (Vec<ValueId>, BodyId) {
    let outs = n.node("Loop", inputs, outputs, vec![]);
    let (node, _) = n.model.producer(outs[0]).unwrap();
    let body = n.model.add_subgraph(node, "body");
    (outs, body)
}

/// The inputs of a Loop body carrying one value of `dims`: the iteration number, the
/// condition and the carried value, named `i`, `c` and `carried`.
fn one_carried(
    m: &mut Model,
    body: BodyId,
    elem: i32,
    dims: &[i64],
    carried: &str,
) -> [ValueId; 3] {
    [
        m.add_input(body, "i", tensor_type(7, &[]), None),
        m.add_input(body, "c", tensor_type(9, &[]), None),
        m.add_input(body, carried, tensor_type(elem, dims), None),
    ]
}

/// A TensorFlow while loop as tf2onnx writes a Keras SimpleRNN: no trip count; the first
/// condition `Less(0.0, 4.0)` computed outside, the body's `Less(Cast(t + 1), Cast(limit))`
/// on an int32 counter it carries (`limit` an outer constant, `one` a body initializer);
/// the step `Gather(X, t)` of an outer sequence; the hidden state carried; the kernel `W`
/// carried through unchanged; every H a scan output. S 4, N 2, I 3, H 2; the last H, the
/// carried-through W and the stacked Hs reach the loss.
fn tf_while_loop_case(n: &mut Net) -> Vec<ValueId> {
    let x = n.param("X", &[4, 2, 3], -1.0, 1.0);
    let w = n.param("W", &[3, 2], -0.8, 0.8);
    let r = n.param("R", &[2, 2], -0.8, 0.8);
    let b = n.param("B", &[2], -0.5, 0.5);
    let h0 = n.param("H0", &[2, 2], -0.5, 0.5);
    let zero = n.konst("zero", &[], &[0.0]);
    let four = n.konst("four", &[], &[4.0]);
    let go = n.op("Less", &[zero, four], vec![]);
    let t0 = n.int32s("t0", &[], &[0]);
    let limit = n.int32s("limit", &[], &[4]);
    let (outs, body) = loop_node(n, &[None, Some(go), Some(t0), Some(h0), Some(w)], 4);
    let elem = n.elem;
    let m = &mut n.model;
    let t = tf_counter_inputs(m, body);
    let h = m.add_input(body, "h", tensor_type(elem, &[2, 2]), None);
    let wk = m.add_input(body, "w", tensor_type(elem, &[3, 2]), None);
    let mut bb = Builder::new(m, body, "test");
    let (t1, cond) = tf_counter_next(&mut bb, t, limit);
    let x_t = bb.op("Gather", &[x, t], vec![], "x_t");
    let xw = bb.op("MatMul", &[x_t, wk], vec![], "xw");
    let hr = bb.op("MatMul", &[h, r], vec![], "hr");
    let s = bb.op("Add", &[xw, hr], vec![], "s");
    let sb = bb.op("Add", &[s, b], vec![], "sb");
    let h1 = bb.op("Tanh", &[sb], vec![], "h1");
    let scan = bb.op("Identity", &[h1], vec![], "h_scan");
    for v in [cond, t1, h1, wk, scan] {
        m.add_output(body, v, None);
    }
    vec![outs[1], outs[2], outs[3]]
}

/// The first inputs of a TensorFlow while loop's body: the iteration number and the
/// condition, which it does not read, and the int32 counter `t` it carries (returned); the
/// carried values come after.
fn tf_counter_inputs(m: &mut Model, body: BodyId) -> ValueId {
    m.add_input(body, "i", tensor_type(7, &[]), None);
    m.add_input(body, "c", tensor_type(9, &[]), None);
    m.add_input(body, "t", tensor_type(6, &[]), None)
}

/// The counter's next value `t + 1` (`one` a body initializer) and the condition to go on,
/// compared in float as tf2onnx writes it: `Less(Cast(t + 1), Cast(limit))`.
fn tf_counter_next(bb: &mut Builder<'_>, t: ValueId, limit: ValueId) -> (ValueId, ValueId) {
    let one = bb.model.add_initializer(
        bb.body,
        "one",
        TensorProto {
            data_type: Some(6),
            int32_data: vec![1],
            ..Default::default()
        },
    );
    let t1 = bb.op("Add", &[t, one], vec![], "t1");
    let t1f = bb.op("Cast", &[t1], vec![attr_int("to", 1)], "t1f");
    let limitf = bb.op("Cast", &[limit], vec![attr_int("to", 1)], "limitf");
    let cond = bb.op("Less", &[t1f, limitf], vec![], "cond");
    (t1, cond)
}

/// A Loop with a trip count M = 3 and no condition, its iteration number the index: the
/// state `A` (carried, float) becomes `A ⊙ g + X[i]`, and `A'²` is scanned. X has 4 steps,
/// so one step of its Split is never read (its gradient is zeros).
fn counted_loop_case(n: &mut Net) -> Vec<ValueId> {
    let x = n.param("X", &[4, 2, 3], -1.0, 1.0);
    let g = n.param("G", &[3], -1.0, 1.0);
    let a0 = n.param("A0", &[2, 3], -1.0, 1.0);
    let trips = n.ints("trips", &[], &[3]);
    let (outs, body) = loop_node(n, &[Some(trips), None, Some(a0)], 2);
    let elem = n.elem;
    let m = &mut n.model;
    let [i, c, a] = one_carried(m, body, elem, &[2, 3], "a");
    let mut bb = Builder::new(m, body, "test");
    let x_i = bb.op("Gather", &[x, i], vec![], "x_i");
    let ag = bb.op("Mul", &[a, g], vec![], "ag");
    let a1 = bb.op("Add", &[ag, x_i], vec![], "a1");
    let sq = bb.op("Mul", &[a1, a1], vec![], "sq");
    let cond = bb.op("Identity", &[c], vec![], "cond");
    for v in [cond, a1, sq] {
        m.add_output(body, v, None);
    }
    outs
}

/// The counted Loop with its Loops kept, its stacked output then sliced along the steps,
/// whose number the shape facts do not know: the last step (`[-1:]`), all but the last
/// (`[:-1]`) and the second (`[1:2]`); Slice's gradient computes its pads at run time.
fn scan_sliced_case(n: &mut Net) -> Vec<ValueId> {
    n.pipeline = PIPELINE_LOOPS_KEPT;
    let outs = counted_loop_case(n);
    let stacked = outs[1];
    let axis = n.ints("axis", &[1], &[0]);
    let mut ys = vec![outs[0]];
    for (start, end) in [(-1, i64::MAX), (0, -1), (1, 2)] {
        let s = n.ints(&format!("start{start}"), &[1], &[start]);
        let e = n.ints(&format!("end{end}"), &[1], &[end]);
        ys.push(n.op("Slice", &[stacked, s, e, axis], vec![]));
    }
    ys
}

/// A case with its Loops kept (`loops=keep`): differentiated by `loop_grad`.
fn loops_kept(build: fn(&mut Net) -> Vec<ValueId>) -> impl FnOnce(&mut Net) -> Vec<ValueId> {
    move |n| {
        n.pipeline = PIPELINE_LOOPS_KEPT;
        build(n)
    }
}

cases! {
    // ---- Loop, unrolled (unroll_loop): ONNX Runtime's Loop is the forward's reference
    loop_tf_while: 17, F32 => tf_while_loop_case;
    loop_tf_while_f64: 17, F64 => tf_while_loop_case;
    loop_trip_count: 17, F32 => counted_loop_case;
    loop_trip_count_f64: 17, F64 => counted_loop_case;
    // ---- Loop, kept (loop_grad): the gradient a Loop over the iterations backwards
    loop_kept_tf_while: 17, F32 => loops_kept(tf_while_loop_case);
    loop_kept_tf_while_f64: 17, F64 => loops_kept(tf_while_loop_case);
    loop_kept_trip_count: 17, F32 => loops_kept(counted_loop_case);
    loop_kept_trip_count_f64: 17, F64 => loops_kept(counted_loop_case);
    loop_kept_scan_sliced: 17, F32 => scan_sliced_case;
    loop_kept_scan_sliced_f64: 17, F64 => scan_sliced_case;
}

#[test]
fn lstm_sequence_lens_is_refused() {
    check_error(
        "lstm_sequence_lens_is_refused",
        14,
        F32,
        "sequence_lens",
        |n| {
            let x = n.param("X", &[3, 2, 4], -1.0, 1.0);
            let w = n.param("W", &[1, 12, 4], -0.6, 0.6);
            let r = n.param("R", &[1, 12, 3], -0.6, 0.6);
            let lens = n.int32s("lens", &[2], &[3, 2]);
            n.node(
                "LSTM",
                &[Some(x), Some(w), Some(r), None, Some(lens)],
                1,
                vec![attr_int("hidden_size", 3)],
            )
        },
    );
}

#[test]
fn attention_with_a_cache_is_refused() {
    check_error(
        "attention_with_a_cache_is_refused",
        23,
        F32,
        "past_key",
        |n| {
            let (q, k, v) = attention_inputs(n, &[1, 2, 3, 4], &[1, 2, 3, 4], &[1, 2, 3, 4]);
            let past_k = n.param("past_key", &[1, 2, 2, 4], -1.0, 1.0);
            let past_v = n.param("past_value", &[1, 2, 2, 4], -1.0, 1.0);
            let ys = n.node(
                "Attention",
                &[Some(q), Some(k), Some(v), None, Some(past_k), Some(past_v)],
                3,
                vec![],
            );
            vec![ys[0]]
        },
    );
}

#[test]
fn attention_scores_output_is_refused() {
    check_error(
        "attention_scores_output_is_refused",
        23,
        F32,
        "qk_matmul_output",
        |n| {
            let (q, k, v) = attention_inputs(n, &[1, 2, 3, 4], &[1, 2, 3, 4], &[1, 2, 3, 4]);
            let ys = n.node("Attention", &[Some(q), Some(k), Some(v)], 4, vec![]);
            vec![ys[0], ys[3]]
        },
    );
}

/// Builds the case and expects the autodiff to refuse it with an error (never a panic)
/// that names the node, its op and `needle`.
fn check_error(
    name: &str,
    opset: i64,
    elem: i32,
    needle: &str,
    build: impl FnOnce(&mut Net) -> Vec<ValueId>,
) {
    if !common::ort_available() {
        return;
    }
    let mut net = Net::new(opset, elem, 1);
    let ys = build(&mut net);
    let (forward, _) = net.finish(&ys);
    let graph = onnx_ga::signature::forward(forward, Path::new("case.onnx"));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        onnx_ga::step::build_step(graph, PIPELINE, true).map(|_| ())
    }));
    let err = match result {
        Err(_) => panic!("{name}: the autodiff panicked"),
        Ok(Ok(())) => panic!("{name}: expected an error"),
        Ok(Err(e)) => format!("{e:#}"),
    };
    eprintln!("ERROR {name}: {err}");
    assert!(err.contains(needle), "{name}: {err}");
}

#[test]
fn conv_transpose_output_shape_is_refused() {
    check_error(
        "conv_transpose_output_shape_is_refused",
        17,
        F32,
        "output_shape",
        |n| {
            let x = n.param("X", &[1, 2, 3, 3], -1.0, 1.0);
            let w = n.param("W", &[2, 2, 3, 3], -1.0, 1.0);
            vec![n.op(
                "ConvTranspose",
                &[x, w],
                vec![
                    attr_ints("strides", &[2, 2]),
                    attr_ints("output_shape", &[6, 6]),
                ],
            )]
        },
    );
}

#[test]
fn grid_sample_reflection_padding_is_refused() {
    check_error(
        "grid_sample_reflection_padding_is_refused",
        20,
        F32,
        "padding_mode 'reflection'",
        |n| {
            let x = n.param("X", &[1, 2, 3, 3], -1.0, 1.0);
            let g = n.param("G", &[1, 2, 2, 2], -1.0, 1.0);
            vec![n.op(
                "GridSample",
                &[x, g],
                vec![attr_string("padding_mode", "reflection")],
            )]
        },
    );
}

/// An If node with condition `cond` and `outputs` outputs, and its two branches, empty.
fn if_node(n: &mut Net, cond: ValueId, outputs: usize) -> (Vec<ValueId>, BodyId, BodyId) {
    let outs = n.node("If", &[Some(cond)], outputs, vec![]);
    let (node, _) = n.model.producer(outs[0]).unwrap();
    let then = n.model.add_subgraph(node, "then_branch");
    let otherwise = n.model.add_subgraph(node, "else_branch");
    (outs, then, otherwise)
}

/// An If on data (`torch.cond`): the condition `ReduceSum(X) > 0` is known only at run
/// time, so the If stays and `if_grad` differentiates it; `positive` picks the sign of X's
/// values and so the branch taken. X [2, 3] is read by both branches and after the If; W
/// only by the then branch, V only by the else branch (the other's gradient is zeros).
/// Two outputs: then `(Tanh(X·W) + c, X ⊙ X)` with `c` an initializer of the branch; else
/// `(Sigmoid(X·V) ⊙ X, X)`, the second the outer value itself through an Identity.
fn if_on_data_case(n: &mut Net, positive: bool) -> Vec<ValueId> {
    let (lo, hi) = if positive { (0.1, 1.0) } else { (-1.0, -0.1) };
    let x = n.param("X", &[2, 3], lo, hi);
    let w = n.param("W", &[3, 3], -0.8, 0.8);
    let v = n.param("V", &[3, 3], -0.8, 0.8);
    let sum = n.op("ReduceSum", &[x], vec![attr_int("keepdims", 0)]);
    let zero = n.konst("zero", &[], &[0.0]);
    let cond = n.op("Greater", &[sum, zero], vec![]);
    let (outs, then, otherwise) = if_node(n, cond, 2);
    let c = n.tensor(&[3], &[0.5, -0.25, 0.125]);
    let m = &mut n.model;
    let c = m.add_initializer(then, "c", c);
    let mut tb = Builder::new(m, then, "test");
    let xw = tb.op("MatMul", &[x, w], vec![], "xw");
    let t = tb.op("Tanh", &[xw], vec![], "t");
    let y0 = tb.op("Add", &[t, c], vec![], "then_y0");
    let y1 = tb.op("Mul", &[x, x], vec![], "then_y1");
    m.add_output(then, y0, None);
    m.add_output(then, y1, None);
    let mut eb = Builder::new(m, otherwise, "test");
    let xv = eb.op("MatMul", &[x, v], vec![], "xv");
    let s = eb.op("Sigmoid", &[xv], vec![], "s");
    let y0 = eb.op("Mul", &[s, x], vec![], "else_y0");
    let y1 = eb.op("Identity", &[x], vec![], "else_y1");
    m.add_output(otherwise, y0, None);
    m.add_output(otherwise, y1, None);
    let after = n.op("Mul", &[outs[0], x], vec![]);
    vec![after, outs[1]]
}

/// An If the shape facts decide (`Gather(Shape(X), 0) > 1`, TorchScript's shape checks): it
/// is replaced by its then branch before differentiation (no If is left in the gradient
/// graph: `if_decided_by_shapes_is_inlined`).
fn if_decided_by_shapes_case(n: &mut Net) -> Vec<ValueId> {
    let x = n.param("X", &[2, 3], -1.0, 1.0);
    let w = n.param("W", &[3, 3], -0.8, 0.8);
    let shape = n.op("Shape", &[x], vec![]);
    let zero = n.ints("zero", &[], &[0]);
    let rows = n.op("Gather", &[shape, zero], vec![]);
    let one = n.ints("one", &[], &[1]);
    let cond = n.op("Greater", &[rows, one], vec![]);
    let (outs, then, otherwise) = if_node(n, cond, 1);
    let m = &mut n.model;
    let mut tb = Builder::new(m, then, "test");
    let xw = tb.op("MatMul", &[x, w], vec![], "xw");
    let y = tb.op("Tanh", &[xw], vec![], "then_y");
    m.add_output(then, y, None);
    let mut eb = Builder::new(m, otherwise, "test");
    let y = eb.op("Neg", &[x], vec![], "else_y");
    m.add_output(otherwise, y, None);
    outs
}

cases! {
    // ---- If: on data (if_grad: an If on the same condition), and decided by the shapes
    if_on_data_then_branch_f64: 17, F64 => |n| if_on_data_case(n, true);
    if_on_data_else_branch_f64: 17, F64 => |n| if_on_data_case(n, false);
    if_on_data_then_branch: 17, F32 => |n| if_on_data_case(n, true);
    if_on_data_else_branch: 17, F32 => |n| if_on_data_case(n, false);
    if_decided_by_shapes_f64: 17, F64 => if_decided_by_shapes_case;
}

/// The If whose condition the shapes decide leaves no If in the gradient graph.
#[test]
fn if_decided_by_shapes_is_inlined() {
    let mut net = Net::new(17, F64, 1);
    let ys = if_decided_by_shapes_case(&mut net);
    net.output_dims = Some(vec![vec![2, 3]]);
    let (forward, _) = net.finish(&ys);
    let graph = onnx_ga::signature::forward(forward, Path::new("case.onnx"));
    let step = onnx_ga::step::build_step(graph, PIPELINE, true).unwrap_or_else(|e| panic!("{e}"));
    let ifs = step
        .model
        .all_nodes()
        .filter(|n| step.model.node(*n).proto.op_type() == "If")
        .count();
    assert_eq!(ifs, 0, "the decided If was inlined");
    let kept = step
        .model
        .all_nodes()
        .any(|n| step.model.node(n).proto.op_type() == "Tanh");
    assert!(kept, "the then branch's Tanh is in the graph");
}

/// A branch that draws random numbers cannot be recomputed by the backward: refused, the
/// error naming the If, the Dropout and why.
#[test]
fn if_with_dropout_in_a_branch_is_refused() {
    check_error(
        "if_with_dropout_in_a_branch_is_refused",
        17,
        F64,
        "holds Dropout",
        |n| {
            let x = n.param("X", &[2, 3], 0.1, 1.0);
            let sum = n.op("ReduceSum", &[x], vec![attr_int("keepdims", 0)]);
            let zero = n.konst("zero", &[], &[0.0]);
            let cond = n.op("Greater", &[sum, zero], vec![]);
            let (outs, then, otherwise) = if_node(n, cond, 1);
            let m = &mut n.model;
            let y = Builder::new(m, then, "test").op("Dropout", &[x], vec![], "dropped");
            m.add_output(then, y, None);
            let y = Builder::new(m, otherwise, "test").op("Neg", &[x], vec![], "negated");
            m.add_output(otherwise, y, None);
            outs
        },
    );
}

/// With `--dropout off` the Dropout in a branch is gone (an Identity there, as it is
/// removed from the main graph), and the If is differentiated as any.
fn if_with_dropout_off_case(n: &mut Net) -> Vec<ValueId> {
    n.pipeline = "autodiff(loss=loss,freeze=k_*,dropout=off),legalize-ort";
    let x = n.param("X", &[2, 3], 0.1, 1.0);
    let w = n.param("W", &[2, 3], -1.0, 1.0);
    let sum = n.op("ReduceSum", &[x], vec![attr_int("keepdims", 0)]);
    let zero = n.konst("zero", &[], &[0.0]);
    let cond = n.op("Greater", &[sum, zero], vec![]);
    let (outs, then, otherwise) = if_node(n, cond, 1);
    let m = &mut n.model;
    let mut tb = Builder::new(m, then, "test");
    let xw = tb.op("Mul", &[x, w], vec![], "xw");
    let y = tb.op("Dropout", &[xw], vec![], "dropped");
    m.add_output(then, y, None);
    let y = Builder::new(m, otherwise, "test").op("Neg", &[x], vec![], "negated");
    m.add_output(otherwise, y, None);
    outs
}

cases! {
    if_with_dropout_off_f64: 17, F64 => if_with_dropout_off_case;
    dropout_ratio_initializer_is_no_parameter_f64: 17, F64 => dropout_ratio_initializer_case;
}

/// A Dropout whose ratio is a float initializer of the model (not frozen, not a constant
/// node): a setting, not a parameter, so X alone is trained. Ratio 0 drops nothing in
/// training mode, so central differences can check X's gradient.
fn dropout_ratio_initializer_case(n: &mut Net) -> Vec<ValueId> {
    let x = n.param("X", &[2, 3], -1.0, 1.0);
    let ratio = n.model.add_initializer(
        MAIN,
        "ratio",
        TensorProto {
            data_type: Some(F64),
            double_data: vec![0.0],
            ..Default::default()
        },
    );
    let t = n.op("Tanh", &[x], vec![]);
    vec![n.op("Dropout", &[t, ratio], vec![])]
}

/// An If in `body` of `model` on `cond` with outputs named from `hints`, and its two
/// branches, empty (control flow nested in a body).
fn if_in(
    model: &mut Model,
    body: BodyId,
    cond: ValueId,
    hints: &[&str],
) -> (Vec<ValueId>, BodyId, BodyId) {
    let node = Builder::new(model, body, "test").node("If", "", &[Some(cond)], hints, vec![]);
    let outs = (0..hints.len()).map(|k| model.output(node, k)).collect();
    let then = model.add_subgraph(node, "then_branch");
    let otherwise = model.add_subgraph(node, "else_branch");
    (outs, then, otherwise)
}

/// A Loop in `body` of `model` with `inputs` and outputs named from `hints`, and its body,
/// empty.
fn loop_in(
    model: &mut Model,
    body: BodyId,
    inputs: &[Option<ValueId>],
    hints: &[&str],
) -> (Vec<ValueId>, BodyId) {
    let node = Builder::new(model, body, "test").node("Loop", "", inputs, hints, vec![]);
    let outs = (0..hints.len()).map(|k| model.output(node, k)).collect();
    (outs, model.add_subgraph(node, "body"))
}

/// A counted Loop (M = 4) whose body holds two Ifs: one on the iteration number (`i == 0`:
/// decided once the Loop is unrolled; an If on data in a kept Loop) and one on the step's
/// data (`ReduceSum(x_i) > 0`: X's first two steps are positive, its last two negative, so
/// both branches run). Body:
/// `a1 = If(i == 0){A ⊙ G}{Tanh(A) ⊙ G} + x_i`, `a2 = If(ReduceSum(x_i) > 0){Sin(a1) ⊙ H}{a1 ⊙ a1 + H}`;
/// it carries a2 and scans `a2 ⊙ x_i`.
fn loop_with_ifs_case(n: &mut Net) -> Vec<ValueId> {
    let up = n.param("X_up", &[2, 2, 3], 0.1, 1.0);
    let down = n.param("X_down", &[2, 2, 3], -1.0, -0.1);
    let x = n.op("Concat", &[up, down], vec![attr_int("axis", 0)]);
    let g = n.param("G", &[3], -1.0, 1.0);
    let h = n.param("H", &[3], -1.0, 1.0);
    let a0 = n.param("A0", &[2, 3], -1.0, 1.0);
    let trips = n.ints("trips", &[], &[4]);
    let first_i = n.ints("first_i", &[], &[0]);
    let zero = n.konst("zero", &[], &[0.0]);
    let (outs, body) = loop_node(n, &[Some(trips), None, Some(a0)], 2);
    let elem = n.elem;
    let m = &mut n.model;
    let [i, c, a] = one_carried(m, body, elem, &[2, 3], "a");
    let mut bb = Builder::new(m, body, "test");
    let x_i = bb.op("Gather", &[x, i], vec![], "x_i");
    let first = bb.op("Equal", &[i, first_i], vec![], "first");
    let sum = bb.op(
        "ReduceSum",
        &[x_i],
        vec![attr_int("keepdims", 0)],
        "step_sum",
    );
    let positive = bb.op("Greater", &[sum, zero], vec![], "positive");
    let cond = bb.op("Identity", &[c], vec![], "cond");
    let (mixed, then, otherwise) = if_in(m, body, first, &["mixed"]);
    let y = Builder::new(m, then, "test").op("Mul", &[a, g], vec![], "ag");
    m.add_output(then, y, None);
    let mut eb = Builder::new(m, otherwise, "test");
    let t = eb.op("Tanh", &[a], vec![], "ta");
    let y = eb.op("Mul", &[t, g], vec![], "tag");
    m.add_output(otherwise, y, None);
    let a1 = Builder::new(m, body, "test").op("Add", &[mixed[0], x_i], vec![], "a1");
    let (a2, then, otherwise) = if_in(m, body, positive, &["a2"]);
    let mut tb = Builder::new(m, then, "test");
    let sin = tb.op("Sin", &[a1], vec![], "sin_a1");
    let y = tb.op("Mul", &[sin, h], vec![], "sin_h");
    m.add_output(then, y, None);
    let mut eb = Builder::new(m, otherwise, "test");
    let sq = eb.op("Mul", &[a1, a1], vec![], "sq_a1");
    let y = eb.op("Add", &[sq, h], vec![], "sq_h");
    m.add_output(otherwise, y, None);
    let scan = Builder::new(m, body, "test").op("Mul", &[a2[0], x_i], vec![], "scanned");
    for v in [cond, a2[0], scan] {
        m.add_output(body, v, None);
    }
    outs
}

/// An If on data (`ReduceSum(X) > 0`) whose branches hold control flow: the then branch an
/// If on data of its own (`ReduceSum(Y) > 0`: `Tanh(X·W) ⊙ Y` or `Sigmoid(X·W) + Y`), the
/// else branch a counted Loop (M = 3, carrying `a = Sin(a ⊙ V) + Y` from X). The signs of X
/// and Y pick the branches.
fn if_holding_control_flow_case(n: &mut Net, x_positive: bool, y_positive: bool) -> Vec<ValueId> {
    let sign = |positive: bool| if positive { (0.1, 1.0) } else { (-1.0, -0.1) };
    let (lo, hi) = sign(x_positive);
    let x = n.param("X", &[2, 3], lo, hi);
    let (lo, hi) = sign(y_positive);
    let y = n.param("Y", &[2, 3], lo, hi);
    let w = n.param("W", &[3, 3], -0.8, 0.8);
    let v = n.param("V", &[3], -1.0, 1.0);
    let zero = n.konst("zero", &[], &[0.0]);
    let trips = n.ints("trips", &[], &[3]);
    let sum = n.op("ReduceSum", &[x], vec![attr_int("keepdims", 0)]);
    let cond = n.op("Greater", &[sum, zero], vec![]);
    let (outs, then, otherwise) = if_node(n, cond, 1);
    let elem = n.elem;
    let m = &mut n.model;
    // then: an If of its own.
    let mut tb = Builder::new(m, then, "test");
    let xw = tb.op("MatMul", &[x, w], vec![], "xw");
    let y_sum = tb.op("ReduceSum", &[y], vec![attr_int("keepdims", 0)], "y_sum");
    let inner_cond = tb.op("Greater", &[y_sum, zero], vec![], "inner_cond");
    let (inner, inner_then, inner_else) = if_in(m, then, inner_cond, &["inner"]);
    let mut ib = Builder::new(m, inner_then, "test");
    let t = ib.op("Tanh", &[xw], vec![], "t_xw");
    let r = ib.op("Mul", &[t, y], vec![], "t_xw_y");
    m.add_output(inner_then, r, None);
    let mut ib = Builder::new(m, inner_else, "test");
    let s = ib.op("Sigmoid", &[xw], vec![], "s_xw");
    let r = ib.op("Add", &[s, y], vec![], "s_xw_y");
    m.add_output(inner_else, r, None);
    m.add_output(then, inner[0], None);
    // else: a Loop.
    let (last, body) = loop_in(m, otherwise, &[Some(trips), None, Some(x)], &["a_last"]);
    let [_i, c, a] = one_carried(m, body, elem, &[2, 3], "a");
    let mut bb = Builder::new(m, body, "test");
    let av = bb.op("Mul", &[a, v], vec![], "av");
    let sin = bb.op("Sin", &[av], vec![], "sin_av");
    let a1 = bb.op("Add", &[sin, y], vec![], "a1");
    let cond_out = bb.op("Identity", &[c], vec![], "cond_out");
    m.add_output(body, cond_out, None);
    m.add_output(body, a1, None);
    m.add_output(otherwise, last[0], None);
    let after = n.op("Mul", &[outs[0], x], vec![]);
    vec![after]
}

/// A counted Loop (M = 2) whose body holds a counted Loop (M = 3): the inner carries
/// `b = Tanh(b ⊙ G + X)` from the outer's state, the outer `a' = b_last ⊙ a` and scans it.
fn loop_in_loop_case(n: &mut Net) -> Vec<ValueId> {
    let x = n.param("X", &[2, 3], -1.0, 1.0);
    let g = n.param("G", &[3], -1.0, 1.0);
    let a0 = n.param("A0", &[2, 3], -1.0, 1.0);
    let outer_trips = n.ints("outer_trips", &[], &[2]);
    let inner_trips = n.ints("inner_trips", &[], &[3]);
    let (outs, outer) = loop_node(n, &[Some(outer_trips), None, Some(a0)], 2);
    let elem = n.elem;
    let m = &mut n.model;
    let [_i, c, a] = one_carried(m, outer, elem, &[2, 3], "a");
    let (b_last, inner) = loop_in(m, outer, &[Some(inner_trips), None, Some(a)], &["b_last"]);
    let _j = m.add_input(inner, "j", tensor_type(7, &[]), None);
    let d = m.add_input(inner, "d", tensor_type(9, &[]), None);
    let b = m.add_input(inner, "b", tensor_type(elem, &[2, 3]), None);
    let mut ib = Builder::new(m, inner, "test");
    let bg = ib.op("Mul", &[b, g], vec![], "bg");
    let pre = ib.op("Add", &[bg, x], vec![], "pre");
    let b1 = ib.op("Tanh", &[pre], vec![], "b1");
    let d_out = ib.op("Identity", &[d], vec![], "d_out");
    m.add_output(inner, d_out, None);
    m.add_output(inner, b1, None);
    let mut ob = Builder::new(m, outer, "test");
    let a1 = ob.op("Mul", &[b_last[0], a], vec![], "a1");
    let scan = ob.op("Identity", &[a1], vec![], "a1_scan");
    let c_out = ob.op("Identity", &[c], vec![], "c_out");
    for v in [c_out, a1, scan] {
        m.add_output(outer, v, None);
    }
    outs
}

cases! {
    // ---- control flow nested in control flow: unrolled (Ifs decided by the iteration, Loops
    // unrolled in turn) and kept (if_grad inside loop_grad, loop_grad inside loop_grad)
    loop_with_ifs_f64: 17, F64 => loop_with_ifs_case;
    loop_with_ifs_kept_f64: 17, F64 => loops_kept(loop_with_ifs_case);
    // (float32 finite differences through four iterations: A0's is 9e-4 here; the float64
    // twins hold every gradient to 3e-9.)
    loop_with_ifs: 17, F32 => |n| {
        n.tolerance = Some(3e-3);
        loop_with_ifs_case(n)
    };
    if_holding_if_then_then_f64: 17, F64 => |n| if_holding_control_flow_case(n, true, true);
    if_holding_if_then_else_f64: 17, F64 => |n| if_holding_control_flow_case(n, true, false);
    if_holding_loop_f64: 17, F64 => |n| if_holding_control_flow_case(n, false, true);
    if_holding_loop_kept_f64: 17, F64 => |n| {
        n.pipeline = PIPELINE_LOOPS_KEPT;
        if_holding_control_flow_case(n, false, true)
    };
    if_holding_if: 17, F32 => |n| if_holding_control_flow_case(n, true, false);
    loop_in_loop_f64: 17, F64 => loop_in_loop_case;
    tf_while_with_if_kept_f64: 17, F64 => loops_kept(tf_while_with_if_case);
    loop_in_loop_kept_f64: 17, F64 => loops_kept(loop_in_loop_case);
}

/// A TensorFlow while loop (no trip count: `Less(Cast(t + 1), Cast(3))` on an int32 counter
/// it carries) whose body holds an If on data: `h' = If(ReduceSum(h) > 0){Tanh(h ⊙ G)}{Sin(h) ⊙ G}`.
/// (On tract too: `nested_control_flow_runs_on_tract`.)
fn tf_while_with_if_case(n: &mut Net) -> Vec<ValueId> {
    let g = n.param("G", &[3], -1.0, 1.0);
    let h0 = n.param("H0", &[2, 3], -1.0, 1.0);
    let zero = n.konst("zero", &[], &[0.0]);
    let t0 = n.int32s("t0", &[], &[0]);
    let limit = n.int32s("limit", &[], &[3]);
    let t0f = n.op("Cast", &[t0], vec![attr_int("to", 1)]);
    let limitf = n.op("Cast", &[limit], vec![attr_int("to", 1)]);
    let go = n.op("Less", &[t0f, limitf], vec![]);
    let (outs, body) = loop_node(n, &[None, Some(go), Some(t0), Some(h0)], 2);
    let elem = n.elem;
    let m = &mut n.model;
    let t = tf_counter_inputs(m, body);
    let h = m.add_input(body, "h", tensor_type(elem, &[2, 3]), None);
    let mut bb = Builder::new(m, body, "test");
    let (t1, cond) = tf_counter_next(&mut bb, t, limit);
    let sum = bb.op("ReduceSum", &[h], vec![attr_int("keepdims", 0)], "h_sum");
    let positive = bb.op("Greater", &[sum, zero], vec![], "positive");
    let (h1, then, otherwise) = if_in(m, body, positive, &["h1"]);
    let mut tb = Builder::new(m, then, "test");
    let hg = tb.op("Mul", &[h, g], vec![], "hg");
    let y = tb.op("Tanh", &[hg], vec![], "tanh_hg");
    m.add_output(then, y, None);
    let mut eb = Builder::new(m, otherwise, "test");
    let sin = eb.op("Sin", &[h], vec![], "sin_h");
    let y = eb.op("Mul", &[sin, g], vec![], "sin_h_g");
    m.add_output(otherwise, y, None);
    for v in [cond, t1, h1[0]] {
        m.add_output(body, v, None);
    }
    vec![outs[1]]
}

/// How many nodes of `op` the gradient graph of `build` holds, in every body.
fn count_in_gradient_graph(build: Build, op: &str) -> usize {
    let mut net = Net::new(17, F64, 1);
    let ys = build(&mut net);
    let pipeline = net.pipeline;
    let (forward, _) = net.finish(&ys);
    let graph = onnx_ga::signature::forward(forward, Path::new("case.onnx"));
    let step = onnx_ga::step::build_step(graph, pipeline, true).unwrap_or_else(|e| panic!("{e}"));
    step.model
        .all_nodes()
        .filter(|n| step.model.node(*n).proto.op_type() == op)
        .count()
}

/// What becomes of the Ifs in a Loop's body. Unrolled: the If on the iteration number is
/// decided in each of the 4 iterations (inlined), the If on the step's data stays in each,
/// and each of those gets a backward If: 8 Ifs, no Loop. Kept: the forward Loop's body
/// holds its 2 Ifs, the backward Loop's body their recomputation (2) and their backward
/// Ifs (2).
#[test]
fn ifs_in_a_loop_body_are_decided_or_kept() {
    assert_eq!(count_in_gradient_graph(loop_with_ifs_case, "Loop"), 0);
    assert_eq!(count_in_gradient_graph(loop_with_ifs_case, "If"), 8);
    let kept = loops_kept_case_of_loop_with_ifs;
    assert_eq!(count_in_gradient_graph(kept, "Loop"), 2);
    assert_eq!(count_in_gradient_graph(kept, "If"), 6);
    // A Loop in a Loop's body, unrolled: the outer Loop's 2 iterations each bring an inner
    // Loop into the main graph, which is unrolled in turn.
    assert_eq!(count_in_gradient_graph(loop_in_loop_case, "Loop"), 0);
}

fn loops_kept_case_of_loop_with_ifs(n: &mut Net) -> Vec<ValueId> {
    n.pipeline = PIPELINE_LOOPS_KEPT;
    loop_with_ifs_case(n)
}

/// The gradient graphs of nested control flow run on tract (its Loops lowered to Scans, its
/// Ifs prepared by `tract_ifs`) as on ONNX Runtime: the loss and every gradient within
/// 1e-5 of ONNX Runtime's, relative to the tensor's norm (float32).
#[test]
fn nested_control_flow_runs_on_tract() {
    if !common::ort_available() {
        return;
    }
    let cases: [(&str, Build); 8] = [
        ("loop_with_ifs", loop_with_ifs_case),
        ("loop_with_ifs_kept", loops_kept_case_of_loop_with_ifs),
        ("if_holding_if_then_then", |n| {
            if_holding_control_flow_case(n, true, true)
        }),
        ("if_holding_if_then_else", |n| {
            if_holding_control_flow_case(n, true, false)
        }),
        ("if_holding_loop", |n| {
            if_holding_control_flow_case(n, false, true)
        }),
        ("loop_in_loop", loop_in_loop_case),
        ("tf_while_with_if_kept", |n| {
            n.pipeline = PIPELINE_LOOPS_KEPT;
            tf_while_with_if_case(n)
        }),
        ("loop_in_loop_kept", |n| {
            n.pipeline = PIPELINE_LOOPS_KEPT;
            loop_in_loop_case(n)
        }),
    ];
    for (name, build) in cases {
        let mut net = Net::new(17, F32, 7);
        let ys = build(&mut net);
        let pipeline = net.pipeline;
        let (forward, _) = net.finish(&ys);
        let graph = onnx_ga::signature::forward(forward, Path::new("case.onnx"));
        let step = onnx_ga::step::build_step(graph, pipeline, true)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let proto = step.model.to_proto();
        let on_ort = session(&proto)
            .run(&[])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let lowered = onnx_ga::passes::lower_for_tract::lower_model(&proto)
            .unwrap_or_else(|e| panic!("{name}: lower-for-tract: {e}"));
        let on_tract =
            onnx_ga::engine::tract::TractSession::new(&lowered, &SessionOptions::default())
                .and_then(|mut s| s.run(&[]))
                .unwrap_or_else(|e| panic!("{name}: tract: {e}"));
        assert_eq!(on_ort.len(), on_tract.len(), "{name}: outputs");
        let mut worst = 0.0f64;
        for ((o, a), (p, b)) in on_ort.iter().zip(&on_tract) {
            assert_eq!(o, p, "{name}: output order");
            let (a, b) = (values(a), values(b));
            let diff = norm(a.iter().zip(&b).map(|(x, y)| x - y));
            let rel = diff / norm(a.iter().copied()).max(1e-30);
            worst = worst.max(rel);
            assert!(
                rel <= 1e-5,
                "{name}: {o}: tract {rel:.1e} from ONNX Runtime"
            );
        }
        eprintln!("MEASURED nested control flow on tract, {name}: {worst:.1e}");
    }
}

/// A Dropout two Ifs deep in a branch is refused as one in the branch itself is: the
/// backward recomputes the branch with everything in it.
#[test]
fn if_with_dropout_in_a_nested_branch_is_refused() {
    check_error(
        "if_with_dropout_in_a_nested_branch_is_refused",
        17,
        F64,
        "holds Dropout",
        |n| {
            let x = n.param("X", &[2, 3], 0.1, 1.0);
            let sum = n.op("ReduceSum", &[x], vec![attr_int("keepdims", 0)]);
            let zero = n.konst("zero", &[], &[0.0]);
            let cond = n.op("Greater", &[sum, zero], vec![]);
            let (outs, then, otherwise) = if_node(n, cond, 1);
            let m = &mut n.model;
            let (inner, inner_then, inner_else) = if_in(m, then, cond, &["inner"]);
            let y = Builder::new(m, inner_then, "test").op("Dropout", &[x], vec![], "dropped");
            m.add_output(inner_then, y, None);
            let y = Builder::new(m, inner_else, "test").op("Abs", &[x], vec![], "abs");
            m.add_output(inner_else, y, None);
            m.add_output(then, inner[0], None);
            let y = Builder::new(m, otherwise, "test").op("Neg", &[x], vec![], "negated");
            m.add_output(otherwise, y, None);
            outs
        },
    );
}

/// A Scan node with `inputs` (states, then scanned), `outputs` outputs and `attrs`, and its
/// body, empty.
fn scan_node(
    n: &mut Net,
    inputs: &[ValueId],
    outputs: usize,
    attrs: Vec<AttributeProto>,
) -> (Vec<ValueId>, BodyId) {
    let inputs: Vec<Option<ValueId>> = inputs.iter().map(|v| Some(*v)).collect();
    let outs = n.node("Scan", &inputs, outputs, attrs);
    let (node, _) = n.model.producer(outs[0]).unwrap();
    let body = n.model.add_subgraph(node, "body");
    (outs, body)
}

/// A Scan (rewritten as a Loop by `scan_as_loop`; ONNX Runtime's Scan is the forward's
/// reference): a state S [2, 3] and a sequence X [4, 2, 3] on axis 0, the body
/// `s' = Tanh(s ⊙ G + x)`, scanning `s' ⊙ s'`. The last state and the stacked outputs reach
/// the loss.
fn scan_case(n: &mut Net) -> Vec<ValueId> {
    let s0 = n.param("S0", &[2, 3], -0.5, 0.5);
    let x = n.param("X", &[4, 2, 3], -1.0, 1.0);
    let g = n.param("G", &[3], -1.0, 1.0);
    let (outs, body) = scan_node(n, &[s0, x], 2, vec![attr_int("num_scan_inputs", 1)]);
    let elem = n.elem;
    let m = &mut n.model;
    let s = m.add_input(body, "s", tensor_type(elem, &[2, 3]), None);
    let x_t = m.add_input(body, "x_t", tensor_type(elem, &[2, 3]), None);
    let mut bb = Builder::new(m, body, "test");
    let sg = bb.op("Mul", &[s, g], vec![], "sg");
    let pre = bb.op("Add", &[sg, x_t], vec![], "pre");
    let s1 = bb.op("Tanh", &[pre], vec![], "s1");
    let y = bb.op("Mul", &[s1, s1], vec![], "y");
    m.add_output(body, s1, Some(tensor_type(elem, &[2, 3])));
    m.add_output(body, y, Some(tensor_type(elem, &[2, 3])));
    outs
}

/// A Scan with its axes and directions set: X [2, 4, 3] scanned on axis 1 backwards and Z
/// [4, 2, 3] on axis 0 forwards; the state's stacked steps on axis 1 in reverse, the
/// steps of `z ⊙ s'` on axis -1 (a new last axis) forwards.
fn scan_axes_directions_case(n: &mut Net) -> Vec<ValueId> {
    let s0 = n.param("S0", &[2, 3], -0.5, 0.5);
    let x = n.param("X", &[2, 4, 3], -1.0, 1.0);
    let z = n.param("Z", &[4, 2, 3], -1.0, 1.0);
    let attrs = vec![
        attr_int("num_scan_inputs", 2),
        attr_ints("scan_input_axes", &[1, 0]),
        attr_ints("scan_input_directions", &[1, 0]),
        attr_ints("scan_output_axes", &[1, -1]),
        attr_ints("scan_output_directions", &[1, 0]),
    ];
    let (outs, body) = scan_node(n, &[s0, x, z], 3, attrs);
    let elem = n.elem;
    let m = &mut n.model;
    let s = m.add_input(body, "s", tensor_type(elem, &[2, 3]), None);
    let x_t = m.add_input(body, "x_t", tensor_type(elem, &[2, 3]), None);
    let z_t = m.add_input(body, "z_t", tensor_type(elem, &[2, 3]), None);
    let mut bb = Builder::new(m, body, "test");
    let pre = bb.op("Add", &[s, x_t], vec![], "pre");
    let s1 = bb.op("Sin", &[pre], vec![], "s1");
    let kept = bb.op("Identity", &[s1], vec![], "kept");
    let y = bb.op("Mul", &[z_t, s1], vec![], "y");
    for v in [s1, kept, y] {
        m.add_output(body, v, Some(tensor_type(elem, &[2, 3])));
    }
    outs
}

cases! {
    // ---- Scan, as the Loop it is (scan_as_loop): unrolled, and kept a Loop (loop_grad)
    scan_f64: 17, F64 => scan_case;
    scan_axes_directions_f64: 17, F64 => scan_axes_directions_case;
    scan_kept_f64: 17, F64 => loops_kept(scan_case);
    scan_axes_directions_kept_f64: 17, F64 => loops_kept(scan_axes_directions_case);
    scan: 17, F32 => scan_case;
}

/// A Scan whose scanned axis is not the one the attribute names in range: refused by name,
/// never a panic.
#[test]
fn scan_with_an_axis_beyond_the_rank_is_refused() {
    check_error(
        "scan_with_an_axis_beyond_the_rank_is_refused",
        17,
        F64,
        "axis 3",
        |n| {
            let s0 = n.param("S0", &[2, 3], -0.5, 0.5);
            let x = n.param("X", &[4, 2, 3], -1.0, 1.0);
            let attrs = vec![
                attr_int("num_scan_inputs", 1),
                attr_ints("scan_input_axes", &[3]),
            ];
            let (outs, body) = scan_node(n, &[s0, x], 1, attrs);
            let elem = n.elem;
            let m = &mut n.model;
            let s = m.add_input(body, "s", tensor_type(elem, &[2, 3]), None);
            let _x_t = m.add_input(body, "x_t", tensor_type(elem, &[2, 3]), None);
            let s1 = Builder::new(m, body, "test").op("Neg", &[s], vec![], "s1");
            m.add_output(body, s1, Some(tensor_type(elem, &[2, 3])));
            n.output_dims = Some(vec![vec![2, 3]]);
            outs
        },
    );
}

/// The Dropout probability of the Loop cases below.
const LOOP_DROPOUT: f64 = 0.3;

/// What a kept Loop's body drew in one run: the Dropout's masks (1 kept, 0 dropped) and the
/// noise, each 4 x [2, 3].
struct Drawn {
    masks: Vec<f64>,
    noise: Vec<f64>,
}

/// A counted Loop (M = 4) whose body draws: `d = Dropout(Tanh(A ⊙ G ⊙ (1 + N / 10) + x_i),
/// 0.3)` with N = RandomNormalLike(A); it carries d and scans `d ⊙ H`. With `drawn` it is the
/// deterministic twin: N = noise[i], and the Dropout `masks[i] ⊙ t / keep` as ONNX Runtime's
/// kernel computes it (keep = 1 - 0.3 in float32, whatever the types).
fn loop_with_draws_case(n: &mut Net, drawn: Option<&Drawn>) -> Vec<ValueId> {
    n.pipeline = PIPELINE_LOOPS_KEPT;
    let x = n.param("X", &[4, 2, 3], -1.0, 1.0);
    let g = n.param("G", &[3], -1.0, 1.0);
    let h = n.param("H", &[3], -1.0, 1.0);
    let a0 = n.param("A0", &[2, 3], -1.0, 1.0);
    let trips = n.ints("trips", &[], &[4]);
    let ratio = n.konst("ratio", &[], &[LOOP_DROPOUT]);
    let one = n.konst("one", &[], &[1.0]);
    let tenth = n.konst("tenth", &[], &[0.1]);
    let twin = drawn.map(|d| {
        let keep = (1.0f32 - LOOP_DROPOUT as f32) as f64;
        (
            n.konst("masks", &[4, 2, 3], &d.masks),
            n.konst("noises", &[4, 2, 3], &d.noise),
            n.konst("keep", &[], &[keep]),
        )
    });
    let (outs, body) = loop_node(n, &[Some(trips), None, Some(a0)], 2);
    let elem = n.elem;
    let m = &mut n.model;
    let [i, c, a] = one_carried(m, body, elem, &[2, 3], "a");
    let mut b = Builder::new(m, body, "test");
    let x_i = b.op("Gather", &[x, i], vec![], "x_i");
    let noise = match twin {
        None => b.op("RandomNormalLike", &[a], vec![], "noise"),
        Some((_, noises, _)) => b.op("Gather", &[noises, i], vec![], "noise"),
    };
    let small = b.op("Mul", &[noise, tenth], vec![], "small_noise");
    let jitter = b.op("Add", &[one, small], vec![], "jitter");
    let ag = b.op("Mul", &[a, g], vec![], "ag");
    let jittered = b.op("Mul", &[ag, jitter], vec![], "jittered");
    let pre = b.op("Add", &[jittered, x_i], vec![], "pre");
    let t = b.op("Tanh", &[pre], vec![], "t");
    let d = match twin {
        None => b.op("Dropout", &[t, ratio], vec![], "d"),
        Some((masks, _, keep)) => {
            let mask_i = b.op("Gather", &[masks, i], vec![], "mask_i");
            let masked = b.op("Mul", &[mask_i, t], vec![], "masked");
            b.op("Div", &[masked, keep], vec![], "d")
        }
    };
    let s = b.op("Mul", &[d, h], vec![], "s");
    let c_out = b.op("Identity", &[c], vec![], "c_out");
    for v in [c_out, d, s] {
        m.add_output(body, v, None);
    }
    outs
}

/// A kept Loop whose body draws (a Dropout, a RandomNormalLike): the backward must use what
/// the forward drew (stacked per iteration), not draw again. The random run's loss and
/// gradients are compared with those of its deterministic twin (the same Loop with what
/// that run drew as constants), whose gradient is checked by central differences in float64.
#[test]
fn loop_kept_with_draws_reads_what_the_forward_drew_f64() {
    if !common::ort_available() {
        return;
    }
    let dropped = loop_draws_against_twin(Engine::Ort);
    eprintln!(
        "MEASURED loop kept with draws: {dropped} of 24 dropped, the random run equals its twin"
    );
}

/// The same on tract, after `lower-for-tract` (the Loops as Scans, the Dropout as a uniform
/// draw: tract runs only inference-mode Dropout, and takes a `RandomNormalLike` for a
/// `RandomNormal` unless its node's name ends in "Like").
#[test]
fn loop_kept_with_draws_trains_on_tract_f64() {
    if !common::ort_available() {
        return;
    }
    let dropped = loop_draws_against_twin(Engine::Tract);
    eprintln!(
        "MEASURED loop kept with draws on tract: {dropped} of 24 dropped, the random run equals its twin"
    );
}

/// Where a test's graph runs.
#[derive(Clone, Copy, Debug)]
enum Engine {
    Ort,
    /// Lowered for it first where needed (`lower_for_tract::prepare`).
    Tract,
}

fn run_on(engine: Engine, model: &ModelProto) -> Vec<(String, Tensor)> {
    match engine {
        Engine::Ort => run(model, &[]),
        Engine::Tract => common::run_tract(model, &Default::default())
            .into_iter()
            .collect(),
    }
}

/// The gradient graph of `build` in float64, as `build_step` makes it.
fn gradient_graph_of(label: &str, build: impl FnOnce(&mut Net) -> Vec<ValueId>) -> ModelProto {
    let mut net = Net::new(17, F64, seed_of(label));
    let ys = build(&mut net);
    let pipeline = net.pipeline;
    let (forward, _) = net.finish(&ys);
    let graph = onnx_ga::signature::forward(forward, Path::new("case.onnx"));
    let step = onnx_ga::step::build_step(graph, pipeline, true)
        .unwrap_or_else(|e| panic!("{label}: {pipeline}: {e}"));
    step.model.to_proto()
}

/// A Dropout's mask as numbers: 1 kept, 0 dropped.
fn mask_values(mask: &Tensor) -> Vec<f64> {
    match mask {
        Tensor::Bool(m) => m.iter().map(|k| *k as u8 as f64).collect(),
        other => panic!("the mask is not bool: {other:?}"),
    }
}

/// `outputs` made outputs of `model` too.
fn with_outputs(mut model: ModelProto, outputs: &[&str]) -> ModelProto {
    let graph = model.graph.as_mut().unwrap();
    for name in outputs {
        graph.output.push(onnx_ga::proto::ValueInfoProto {
            name: Some(name.to_string()),
            ..Default::default()
        });
    }
    model
}

/// Every output of `twin` equals the random run's of that name within `tolerance` relative;
/// returns how many were compared.
fn equals_its_twin(
    twin: &[(String, Tensor)],
    random: &[(String, Tensor)],
    tolerance: f64,
) -> usize {
    for (name, t) in twin {
        let got = &random.iter().find(|(o, _)| o == name).unwrap().1;
        let (a, b) = (values(t), values(got));
        let rel = norm(a.iter().zip(&b).map(|(x, y)| x - y)) / norm(a.iter().copied()).max(1e-30);
        assert!(
            rel <= tolerance,
            "{name}: the random run is {rel:.1e} from the twin"
        );
    }
    twin.len()
}

/// [`loop_with_draws_case`] run on `engine` against its twin; returns how many of the 24
/// mask entries dropped.
fn loop_draws_against_twin(engine: Engine) -> usize {
    const TWIN: &str = "loop_kept_with_draws_twin_f64";
    // The random run, what its forward drew made outputs of the gradient graph.
    let random = gradient_graph_of(TWIN, |n| loop_with_draws_case(n, None));
    let stacked = |suffix: &str| {
        random
            .graph
            .as_ref()
            .unwrap()
            .node
            .iter()
            .filter(|n| n.op_type() == "Loop")
            .flat_map(|n| n.output.iter())
            .find(|o| o.ends_with(suffix))
            .unwrap_or_else(|| panic!("no {suffix} among the Loops' outputs"))
            .clone()
    };
    let (masks, noise) = (stacked("_mask_stacked"), stacked("noise_stacked"));
    let outs = run_on(engine, &with_outputs(random, &[&masks, &noise]));
    let output = |name: &str| &outs.iter().find(|(o, _)| o == name).unwrap().1;
    let drawn = Drawn {
        masks: mask_values(output(&masks)),
        noise: values(output(&noise)),
    };
    assert_eq!((drawn.masks.len(), drawn.noise.len()), (24, 24));
    let dropped = drawn.masks.iter().filter(|k| **k == 0.0).count();
    assert!(
        (1..24).contains(&dropped),
        "{dropped} of 24 dropped: the case needs both"
    );
    // The twin, its gradient against central differences.
    check(TWIN, 17, F64, |n| loop_with_draws_case(n, Some(&drawn)));
    let twin = run_on(
        engine,
        &gradient_graph_of(TWIN, |n| loop_with_draws_case(n, Some(&drawn))),
    );
    assert_eq!(
        equals_its_twin(&twin, &outs, 1e-12),
        5,
        "loss and four gradients"
    );
    dropped
}

/// A Dropout (0.3) in the main graph trains on tract: `d = Dropout(Tanh(X · W))`, the loss
/// on `d ⊙ H`. Its mask (output 1, which the gradient reads) made a graph output, the twin is
/// the same graph with that mask as a constant (`mask ⊙ t / keep`), its gradient checked by
/// central differences; the tract run's loss and gradients equal the twin's on tract (to the
/// float32 scale of the gradient's `DropoutGrad`).
#[test]
fn dropout_trains_on_tract_f64() {
    if !common::ort_available() {
        return;
    }
    const TWIN: &str = "dropout_on_tract_twin_f64";
    let random = gradient_graph_of(TWIN, |n| dropout_case(n, None));
    let mask = random
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .find(|n| n.op_type() == "Dropout")
        .and_then(|n| n.output.get(1))
        .expect("the forward Dropout gives its mask to the gradient")
        .clone();
    let outs = run_on(Engine::Tract, &with_outputs(random, &[&mask]));
    let masks = mask_values(&outs.iter().find(|(o, _)| *o == mask).unwrap().1);
    let dropped = masks.iter().filter(|k| **k == 0.0).count();
    assert!(
        (1..masks.len()).contains(&dropped),
        "{dropped} of {} dropped: the case needs both",
        masks.len()
    );
    check(TWIN, 17, F64, |n| dropout_case(n, Some(&masks)));
    let twin = run_on(
        Engine::Tract,
        &gradient_graph_of(TWIN, |n| dropout_case(n, Some(&masks))),
    );
    // Not 1e-12: the gradient is `DropoutGrad`'s, whose scale 1 / (1 - ratio) is a float32
    // (as ONNX Runtime's kernel makes it), where the twin divides by keep (measured: 6.8e-9).
    // A backward that drew a fresh mask would be tens of percent off.
    assert_eq!(
        equals_its_twin(&twin, &outs, 1e-7),
        4,
        "loss and three gradients"
    );
    eprintln!(
        "MEASURED Dropout on tract: {dropped} of {} dropped, the run equals its twin",
        masks.len()
    );
}

/// What tract draws for a Dropout (0.3, float32) after `lower-for-tract`: of 100,000 ones,
/// 30% ± 1% dropped (the binomial's deviation is 0.15%), each kept one 1 / 0.7 as ONNX
/// Runtime's kernel makes it (`1 / (1.0f - 0.3)`), the mask true exactly where it is kept;
/// and two runs of one session draw differently.
#[test]
fn dropout_on_tract_drops_its_ratio() {
    const N: usize = 100_000;
    let mut model = common::empty_model(17);
    let (x, ratio, training) = (
        model.add_initializer(MAIN, "x", tensor_f32(&[N as i64], &vec![1.0; N])),
        model.add_initializer(MAIN, "ratio", tensor_f32(&[], &[0.3])),
        model.add_initializer(MAIN, "training", tensor_bool(&[], &[true])),
    );
    let dropout = Builder::new(&mut model, MAIN, "test").node(
        "Dropout",
        "",
        &[Some(x), Some(ratio), Some(training)],
        &["y", "mask"],
        vec![],
    );
    for slot in 0..2 {
        let v = model.output(dropout, slot);
        model.add_output(MAIN, v, None);
    }
    // As `train --engine tract` prepares a model: lowered only where it needs to be.
    let proto = model.to_proto();
    let prepared = onnx_ga::passes::lower_for_tract::prepare(&proto)
        .unwrap_or_else(|e| panic!("lower-for-tract: {e}"));
    assert!(
        !prepared
            .graph
            .as_ref()
            .unwrap()
            .node
            .iter()
            .any(|n| n.op_type() == "Dropout"),
        "the training Dropout is left for tract"
    );
    let mut session =
        onnx_ga::engine::tract::TractSession::new(&prepared, &SessionOptions::default())
            .unwrap_or_else(|e| panic!("tract: {e}"));
    let mut draw = || {
        let outs = session.run(&[]).unwrap_or_else(|e| panic!("tract: {e}"));
        let kept: Vec<bool> = mask_values(&outs[1].1).iter().map(|k| *k == 1.0).collect();
        (values(&outs[0].1), kept)
    };
    let (y, mask) = draw();
    let scale = 1.0f32 / (1.0f32 - 0.3f32);
    for (v, kept) in y.iter().zip(&mask) {
        let want = if *kept { scale as f64 } else { 0.0 };
        assert_eq!(*v, want, "a value the mask says is {kept}");
    }
    let dropped = mask.iter().filter(|k| !**k).count() as f64 / N as f64;
    assert!(
        (dropped - 0.3).abs() <= 0.01,
        "{dropped} dropped for a ratio of 0.3"
    );
    let (_, again) = draw();
    assert_ne!(mask, again, "two runs drew the same mask");
    eprintln!("MEASURED Dropout(0.3) on tract: {dropped:.4} of {N} dropped");
}

/// `d = Dropout(Tanh(X · W), 0.3)` (X [5, 4], W [4, 6]), scanned as `d ⊙ H`; with `masks`
/// the deterministic twin `masks ⊙ t / keep` (keep = 1 - 0.3 in float32).
fn dropout_case(n: &mut Net, masks: Option<&[f64]>) -> Vec<ValueId> {
    let x = n.param("X", &[5, 4], -1.0, 1.0);
    let w = n.param("W", &[4, 6], -1.0, 1.0);
    let h = n.param("H", &[6], -1.0, 1.0);
    let xw = n.op("MatMul", &[x, w], vec![]);
    let t = n.op("Tanh", &[xw], vec![]);
    let d = match masks {
        None => {
            let ratio = n.konst("ratio", &[], &[LOOP_DROPOUT]);
            n.op("Dropout", &[t, ratio], vec![])
        }
        Some(masks) => {
            let keep = (1.0f32 - LOOP_DROPOUT as f32) as f64;
            let (masks, keep) = (
                n.konst("masks", &[5, 6], masks),
                n.konst("keep", &[], &[keep]),
            );
            let masked = n.op("Mul", &[masks, t], vec![]);
            n.op("Div", &[masked, keep], vec![])
        }
    };
    vec![n.op("Mul", &[d, h], vec![])]
}
