"""The bundled copy of DeepSpeed's config tables, used when deepspeed is not importable.

Taken from DeepSpeed ``FALLBACK_VERSION``; ``tests/test_ds_check.py`` compares every table with the installed
DeepSpeed, so a stale copy shows up as a failing test, not as wrong verdicts. Data only: :mod:`.schema` reads it.
"""

from __future__ import annotations

FALLBACK_VERSION = "0.19.8"  # the DeepSpeed the bundled tables were taken from

# fmt: off
# -- bundled copy of DeepSpeed 0.19.8's tables (used when deepspeed is not importable) --
_FALLBACK_TOP_LEVEL = (
    "activation_checkpointing", "aio", "bf16", "bfloat16", "checkpoint", "comet", "comms_logger",
    "communication_data_type", "compile", "csv_monitor", "data_efficiency", "data_types", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel", "flops_profiler",
    "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping", "gradient_predivide_factor",
    "hybrid_engine", "log_level", "managed_gradient_accumulation", "memory_breakdown", "optimizer", "pipeline",
    "prescale_gradients", "scheduler", "seq_parallel_communication_data_type", "steps_per_print", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization", "autotuning",
)
_FALLBACK_MODELS: dict[str, str] = {  # block -> the model DeepSpeed validates it with (extra keys forbidden)
    'bf16': 'deepspeed.runtime.precision_config:DeepSpeedBF16Config',
    'comet': 'deepspeed.monitor.config:CometConfig',
    'comms_logger': 'deepspeed.comm.config:CommsLoggerConfig',
    'compile': 'deepspeed.compile.config:CompileConfig',
    'csv_monitor': 'deepspeed.monitor.config:CSVConfig',
    'fp16': 'deepspeed.runtime.precision_config:DeepSpeedFP16Config',
    'hybrid_engine': 'deepspeed.runtime.config:HybridEngineConfig',
    'tensor_parallel': 'deepspeed.runtime.tensor_parallel.config:TPTrainingConfig',
    'tensor_parallel.tensor_parallel': 'deepspeed.runtime.tensor_parallel.config:TPConfig',
    'tensorboard': 'deepspeed.monitor.config:TensorBoardConfig',
    'wandb': 'deepspeed.monitor.config:WandbConfig',
    'weight_quantization': 'deepspeed.inference.config:WeightQuantConfig',
    'zero_optimization': 'deepspeed.runtime.zero.config:DeepSpeedZeroConfig',
    'zero_optimization.offload_param': 'deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadParamConfig',
    'zero_optimization.offload_optimizer': 'deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadOptimizerConfig',
    'zero_optimization.zenflow': 'deepspeed.runtime.zenflow.zenflow_config:ZenFlowConfig',
    'zero_optimization.leaf_module': 'deepspeed.runtime.zero.leaf_module_config:DeepSpeedZeroLeafModuleConfig',
}
_FALLBACK_BLOCKS: dict[str, dict[str, str]] = {
    'bf16': {
        'enabled': 'bool default=false',
        'immediate_grad_update': 'bool default=false',
        'check_grad_overflow': 'bool default=true',
        'bf16_master_weights_and_grads': 'bool default=false',
        'bf16_optimizer_states': 'bool default=false',
    },
    'comet': {
        'enabled': 'bool default=false',
        'samples_log_interval': 'int default=100',
        'project': 'str nullable default=null',
        'workspace': 'str nullable default=null',
        'api_key': 'str nullable default=null',
        'experiment_name': 'str nullable default=null',
        'experiment_key': 'str nullable default=null',
        'online': 'bool nullable default=null',
        'mode': 'str nullable default=null',
    },
    'comms_logger': {
        'enabled': 'bool default=false',
        'prof_all': 'bool default=true',
        'prof_ops': 'any',
        'verbose': 'bool default=false',
        'debug': 'bool default=false',
    },
    'compile': {
        'deepcompile': 'bool default=false',
        'autoep_non_moe': 'bool default=false',
        'free_activation': 'bool default=false',
        'free_activation_threshold': 'int default=10485760',
        'offload_activation': 'bool default=false',
        'offload_activation_pin_memory': 'bool default=true',
        'offload_opt_states': 'bool default=false',
        'double_buffer': 'bool default=true',
        'symmetric_memory': 'bool default=false',
        'debug_log': 'bool default=false',
        'offload_parameters': 'bool default=false',
        'sync_before_reduce': 'bool default=false',
        'sync_after_reduce': 'bool default=false',
        'sync_before_allgather': 'bool default=false',
        'sync_after_allgather': 'bool default=false',
        'keep_int_input_tensors': 'bool default=true',
        'keep_all_input_tensors': 'bool default=false',
        'passes': 'any nullable default=null',
    },
    'csv_monitor': {
        'enabled': 'bool default=false',
        'output_path': 'str default=""',
        'job_name': 'str default="DeepSpeedJobName"',
    },
    'fp16': {
        'enabled': 'bool default=false',
        'auto_cast': 'bool default=false',
        'loss_scale': 'float default=0',
        'initial_scale_power': 'int default=16',
        'loss_scale_window': 'int default=1000',
        'hysteresis': 'int default=2',
        'consecutive_hysteresis': 'bool default=false',
        'min_loss_scale': 'int default=1',
        'fp16_master_weights_and_grads': 'bool default=false',
    },
    'hybrid_engine': {
        'enabled': 'bool default=false',
        'max_out_tokens': 'int gt=0 default=512',
        'inference_tp_size': 'int default=1',
        'release_inference_cache': 'bool default=false',
        'pin_parameters': 'bool default=true',
        'tp_gather_partition_size': 'int default=8',
        'enable_cuda_graph': 'bool default=false',
    },
    'tensor_parallel': {
        'dtype': 'any',
        'autotp_size': 'int default=0',
        'tp_overlap_comm': 'bool default=false',
        'vocab_parallel_lm_head': 'bool nullable default=null',
        'vocab_parallel_ce_backend': 'any default="torch"',
        'tensor_parallel': 'block ref=tensor_parallel.tensor_parallel',
        'tp': 'block ref=tensor_parallel.tensor_parallel',
        'injection_policy_tuple': 'any nullable default=null',
        'partition_config': 'any nullable default=null',
        'preset_model': 'str nullable default=null',
        'keep_module_on_host': 'bool default=false',
        'replace_with_kernel_inject': 'bool default=false',
        'kernel_inject': 'bool default=false',
    },
    'tensor_parallel.tensor_parallel': {
        'tp_size': 'int default=1',
        'tp_grain_size': 'int default=1',
        'mpu': 'any default=null',
        'tp_group': 'any default=null',
    },
    'tensorboard': {
        'enabled': 'bool default=false',
        'output_path': 'str default=""',
        'job_name': 'str default="DeepSpeedJobName"',
    },
    'wandb': {
        'enabled': 'bool default=false',
        'group': 'str nullable default=null',
        'team': 'str nullable default=null',
        'project': 'str default="deepspeed"',
    },
    'weight_quantization': {
        'enabled': 'bool default=true',
        'num_bits': 'int default=8',
        'q_type': 'choice values=asymmetric,symmetric default="symmetric"',
        'q_groups': 'int default=1',
        'quantized_initialization': 'any',
        'post_init_quant': 'any',
    },
    'zero_optimization': {
        'stage': 'choice values=0,1,2,3 default=0',
        'contiguous_gradients': 'bool default=true',
        'reduce_scatter': 'bool default=true',
        'reduce_bucket_size': 'int gt=0 default=500000000',
        'use_multi_rank_bucket_allreduce': 'bool default=true',
        'allgather_partitions': 'bool default=true',
        'allgather_bucket_size': 'int ge=0 default=500000000',
        'overlap_comm': 'bool nullable default=null',
        'compute_grad_norm': 'bool default=true',
        'load_from_fp32_weights': 'bool default=true',
        'elastic_checkpoint': 'bool default=false',
        'offload_param': 'block ref=zero_optimization.offload_param nullable default=null',
        'offload_optimizer': 'block ref=zero_optimization.offload_optimizer nullable default=null',
        'zenflow': 'block ref=zero_optimization.zenflow nullable default=null',
        'sub_group_size': 'int ge=0 default=1000000000',
        'cpu_offload_param': 'bool nullable default=null deprecated=offload_param',
        'cpu_offload_use_pin_memory': 'bool nullable default=null deprecated=offload_param~or~offload_optimizer',
        'cpu_offload': 'bool nullable default=null deprecated=offload_optimizer',
        'prefetch_bucket_size': 'int ge=0 default=50000000',
        'stage3_prefetch_bucket_size': 'int ge=0 default=50000000',
        'param_persistence_threshold': 'int ge=0 default=100000',
        'stage3_param_persistence_threshold': 'int ge=0 default=100000',
        'model_persistence_threshold': 'int ge=0 default=9223372036854775807',
        'stage3_model_persistence_threshold': 'int ge=0 default=9223372036854775807',
        'max_live_parameters': 'int ge=0 default=1000000000',
        'stage3_max_live_parameters': 'int ge=0 default=1000000000',
        'max_reuse_distance': 'int ge=0 default=1000000000',
        'stage3_max_reuse_distance': 'int ge=0 default=1000000000',
        'gather_16bit_weights_on_model_save': 'bool default=false',
        'stage3_gather_16bit_weights_on_model_save': 'bool default=false',
        'module_granularity_threshold': 'int default=0',
        'stage3_module_granularity_threshold': 'int default=0',
        'use_all_reduce_for_fetch_params': 'bool default=false',
        'stage3_use_all_reduce_for_fetch_params': 'bool default=false',
        'allgather_sequential': 'bool default=false',
        'stage3_allgather_sequential': 'bool default=false',
        'stage3_gather_fp16_weights_on_model_save': 'bool default=false deprecated=gather_16bit_weights_on_model_save',
        'ignore_unused_parameters': 'bool default=true',
        'legacy_stage1': 'bool default=false',
        'round_robin_gradients': 'bool default=false',
        'parameter_alignment': 'bool default=false',
        'zero_hpz_partition_size': 'int ge=0 default=1',
        'zero_quantized_weights': 'bool default=false',
        'zero_quantized_nontrainable_weights': 'bool default=false',
        'zero_quantized_gradients': 'bool default=false',
        'memory_efficient_linear': 'bool default=true',
        'pipeline_loading_checkpoint': 'bool default=false',
        'override_module_apply': 'bool default=true',
        'log_trace_cache_warnings': 'bool default=false',
        'enable_sanity_checks': 'bool default=false',
        'save_muon_momentum_buffer_in_memory': 'bool default=false',
        'leaf_module': 'block ref=zero_optimization.leaf_module',
    },
    'zero_optimization.offload_param': {
        'device': 'choice values=none,cpu,nvme default="none"',
        'nvme_path': 'path nullable default=null',
        'buffer_count': 'int ge=0 default=5',
        'buffer_size': 'int ge=0 default=100000000',
        'max_in_cpu': 'int ge=0 default=1000000000',
        'pin_memory': 'bool default=true',
    },
    'zero_optimization.offload_optimizer': {
        'device': 'choice values=none,cpu,nvme default="none"',
        'nvme_path': 'path nullable default=null',
        'buffer_count': 'int ge=0 default=4',
        'pin_memory': 'bool default=true',
        'pipeline_read': 'bool default=false',
        'pipeline_write': 'bool default=false',
        'fast_init': 'bool default=false',
        'ratio': 'float ge=0 le=1 default=1.0',
        'super_offload': 'bool default=false',
        'cpuadam_cores_perc': 'float ge=0 le=1 default=0.8',
    },
    'zero_optimization.zenflow': {
        'topk_ratio': 'float gt=0 lt=1 default=0.1',
        'select_strategy': 'str default="auto"',
        'select_interval': 'any default="auto"',
        'update_interval': 'any default="auto"',
        'overlap_step': 'bool default=false',
        'offload': 'bool default=false',
        'auto_ratio': 'float ge=0 le=1 default=0.99',
        'full_warm_up_rounds': 'int default=0',
        'pt_reserved_cores_perc': 'float ge=0 le=1 default=0.5',
        'steps_per_epoch': 'int nullable default=null',
    },
    'zero_optimization.leaf_module': {
        'classes': 'any',
        'names': 'any',
        'name_suffixes': 'any',
    },
}
_FALLBACK_REMOVED: dict[str, dict[str, str]] = {
    '': {
        'nebula': (
            "Nebula checkpointing has been removed. A leftover 'nebula' block would be ignored and checkpoints "
            'would silently fall back to local torch.save. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'compression_training': (
            "The DeepSpeed compression library has been removed. A leftover 'compression_training' block would be"
            ' ignored and the model would train unquantized. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'amp': (
            "NVIDIA Apex AMP integration has been removed. Use DeepSpeed 'fp16', 'bf16', or 'torch_autocast' "
            'instead. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'quantize_training': (
            "Mixture-of-Quantization (MoQ) / 'quantize_training' has been removed. See "
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'sparse_gradients': (
            'Sparse compression of dense torch.nn.Embedding gradients has been removed. A leftover '
            "'sparse_gradients' flag would be ignored and those gradients would be reduced dense. Gradients from "
            'an embedding constructed with sparse=True are still reduced sparsely and need no config flag. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'eigenvalue': (
            "Eigenvalue-based Mixture-of-Quantization (MoQ) has been removed; the standalone 'eigenvalue' "
            'configuration block is no longer supported. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'sparse_attention': (
            "DeepSpeed Sparse Attention has been removed; the 'sparse_attention' configuration block is no longer"
            ' supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'elasticity': (
            "Elastic training has been removed; the 'elasticity' configuration block is no longer supported. Set "
            'train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps directly. '
        ),
        'graph_harvesting': (
            "Graph harvesting has been removed; the 'graph_harvesting' configuration option is no longer "
            'supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'curriculum_learning': (
            "Legacy top-level 'curriculum_learning' has been removed. Use "
            "'data_efficiency.data_sampling.curriculum_learning' instead. See "
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'progressive_layer_drop': (
            "Progressive Layer Dropping has been removed; the 'progressive_layer_drop' configuration block is no "
            'longer supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
    },
    'zero_optimization': {
        'mics_shard_size': (
            "MiCS ZeRO-3 sharding has been removed; 'zero_optimization.mics_shard_size' is no longer supported. "
            'See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'mics_hierarchical_params_gather': (
            "MiCS ZeRO-3 sharding has been removed; 'zero_optimization.mics_hierarchical_params_gather' is no "
            'longer supported. See https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
        'zeropp_loco_param': (
            "LoCo-Zero++ has been removed; 'zero_optimization.zeropp_loco_param' is no longer supported. Remove "
            'this key to use standard ZeRO++ quantized gradients without LoCo error feedback. See '
            'https://github.com/deepspeedai/DeepSpeed/issues/8489.'
        ),
    },
}
_FALLBACK_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
_FALLBACK_SCHEDULERS_TEXT = {  # name: (params after `optimizer`, the required ones), space-separated
    "LRRangeTest": ("lr_range_test_min_lr lr_range_test_step_size lr_range_test_step_rate lr_range_test_staircase"
                    " last_batch_iteration", ""),
    "OneCycle": ("cycle_min_lr cycle_max_lr decay_lr_rate cycle_first_step_size cycle_second_step_size"
                 " cycle_first_stair_count cycle_second_stair_count decay_step_size cycle_momentum cycle_min_mom"
                 " cycle_max_mom decay_mom_rate last_batch_iteration", "cycle_min_lr cycle_max_lr"),
    "WarmupLR": ("warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration", ""),
    "WarmupDecayLR": ("total_num_steps warmup_min_lr warmup_max_lr warmup_num_steps warmup_type last_batch_iteration",
                      "total_num_steps"),
    "WarmupCosineLR": ("total_num_steps warmup_min_ratio warmup_num_steps cos_min_ratio warmup_type"
                       " last_batch_iteration", "total_num_steps"),
}
_FALLBACK_SCHEDULERS = {n: (tuple(p.split()), tuple(r.split())) for n, (p, r) in _FALLBACK_SCHEDULERS_TEXT.items()}
# Keys whose DeepSpeed default is "auto" itself, so "auto" there is DeepSpeed's own value (not a placeholder for the
# HF Trainer), by where DeepSpeed keeps them (see schema_auto.ds_auto_from_deepspeed for how each is read):
_FALLBACK_DS_AUTO: dict[str, tuple[str, ...]] = {
    "pipeline": ("pipeline.stages",),  # runtime/config.py get_pipeline_config
    "config": ("data_types.keep_in_fp32_modules",),  # constants.py KEEP_IN_FP32_MODULES_DEFAULT
    "models": ("zero_optimization.zenflow.select_interval", "zero_optimization.zenflow.select_strategy",
               "zero_optimization.zenflow.update_interval"),  # runtime/zenflow/zenflow_config.py ZenFlowConfig
    "expert_parallel": ("expert_parallel.combine_impl", "expert_parallel.routed_scaling_factor",
                        "expert_parallel.row_weighting_impl", "expert_parallel.score_apply",
                        "expert_parallel.score_func", "expert_parallel.top_k"),  # auto_ep_config.parse_autoep_config
}
# fmt: on
