"""Every option's independent reference: what checks its semantics without the code under test.

The equivalence matrix compares a layout with one process running the same code, so a bug
the single process shares passes it (a balancing loss with each micro-batch's own counts,
in every layout, did). Each model, router, loss, data, optimizer and training option is
therefore checked against something written independently of it: a hand computation,
transformers' modeling code, a closed-form property ("upcycled at step 0 equals the dense
model"), a torch reference op. ``REFERENCES`` says which, and which test runs it;
tests/parallel/test_matrix.py fails for a config key of these sections without a row (or
a ``NO_NUMBERS`` entry: a key that changes no trained number) and for a row whose test does
not exist, and writes the table into docs/matrix.md.

Adding an option: one line in ``REFERENCES``,

    "section.key": ("what checks it, independently of the code", "tests/path.py::test_name"),

the test being a node id (a parametrized test without its brackets, or with them to name
one case) or a short name of ``TESTS``.
"""

from __future__ import annotations

SECTIONS = ("model", "moe", "data", "optim", "train")
"""The config sections whose every key needs a row. ``parallel.*`` keys are layouts: the
equivalence matrix proves each against one process and ``test_every_parallel_key_is_
exercised_and_observable`` that each is honoured; ``log.*`` keys change what is written,
never a trained number (the figures the dashboards show are checked against independent
counts in tests/tools/ and tests/train/test_specialization.py)."""

TESTS = {
    "hf": "tests/interop/test_families.py::test_forward_matches_transformers",
    "hf_dense": "tests/interop/test_families.py::test_dense_forward_matches_transformers",
    "hf_options": "tests/interop/test_families.py::test_routing_options_matter",
    "hf_gpt_oss": "tests/interop/test_families.py::test_gpt_oss_options_matter",
    "loop": "tests/model/test_moe_equivalence.py::test_matches_per_token_loop",
    "dense": "tests/model/test_moe_equivalence.py::test_one_expert_top1_equals_dense_swiglu",
    "dropless": "tests/model/test_moe_equivalence.py::test_dropless_equals_capacity_without_drops",
    "plan": "tests/model/test_dispatch_plan.py::test_expert_capacity_table",
    "policy": "tests/model/test_dispatch_plan.py::test_drop_policy_keeps_the_right_assignments",
    "groups": "tests/model/test_dispatch_plan.py::test_capacity_is_per_token_group",
    "pad": "tests/model/test_dispatch_plan.py::test_pad_to_capacity_rows",
    "lb": "tests/model/test_losses.py::test_load_balancing_hand_computed",
    "inject": "tests/model/test_losses.py::test_moe_layer_injects_loss_gradient",
    "records": "tests/model/test_losses.py::test_moe_layer_records_loss_values",
    "global": "tests/train/test_global_aux_loss.py"
    "::test_global_balance_loss_gradient_and_value_match_the_definition",
    "bias": "tests/model/test_expert_bias.py::test_update_expert_bias_hand_example",
    "jitter": "tests/model/test_router.py::test_jitter_scales_router_input_within_eps_in_training_only",
    "router": "tests/model/test_router.py::test_topk_ids_scores_and_weights",
    "upcycle": "tests/interop/test_upcycle.py::test_upcycled_model_starts_as_the_dense_model",
    "upcycle_parts": "tests/interop/test_upcycle.py::test_fine_grained_parts_router_and_noise",
    "placement": "tests/model/test_transformer.py::test_every_n_layers_placement",
    "closed": "tests/model/test_closed_forms.py",
    "packing": "tests/data/test_batches.py::test_batches_are_shifted_packed_sequences_of_the_stream",
    "formats": "tests/data/test_loading.py::test_text_json_parquet_load_the_same_documents",
    "folders": "tests/data/test_loading.py::test_folder_splits_glob_and_format_override",
    "heldout": "tests/data/test_corpus.py::test_eval_split_is_held_out_two_percent_of_each_domain",
    "schedule": "tests/train/test_optim.py::test_warmup_cosine_values",
    "adamw": "tests/train/test_optim.py::test_param_groups_membership",
    "muon": "tests/train/test_muon.py"
    "::test_matrices_equal_torch_muon_and_each_expert_equals_it_on_its_slice",
    "muon_params": "tests/train/test_muon.py"
    "::test_muon_takes_the_hidden_matrices_and_each_choice_is_a_key",
    "resume": "tests/train/test_trainer.py::test_trains_logs_every_metric_and_resumes_exactly",
    "replay": "tests/train/test_routing_replay.py"
    "::test_replaying_the_runs_own_routing_reproduces_it_exactly",
    "nonfinite": "tests/train/test_resilience.py"
    "::test_nonfinite_skip_leaves_parameters_untouched_and_counts",
    "golden": "tests/test_golden.py::test_golden_curves",
}
"""Short names of the tests the rows cite."""

# key -> (the independent reference, the test that runs it: a node id or a TESTS name).
# One line a row, however long (ruff leaves this table as written: pyproject.toml).
# fmt: off
REFERENCES: dict[str, tuple[str, str]] = {
    # model
    "model.vocab_size": ("transformers' modeling code (tiny random models)", "hf"),
    "model.dim": ("transformers' modeling code", "hf"),
    "model.n_layers": ("transformers' modeling code", "hf"),
    "model.n_heads": ("transformers' modeling code", "hf"),
    "model.n_kv_heads": ("GQA equals MHA with repeated kv heads; transformers", "hf"),
    "model.ffn_dim": ("transformers' dense MLP (Llama, Mistral, Qwen3)", "hf_dense"),
    "model.max_seq_len": ("the RoPE table's rows: transformers at every position", "hf"),
    "model.rope_theta": ("transformers (Mixtral's theta 1e6)", "hf"),
    "model.norm_eps": ("transformers' RMSNorm", "hf"),
    "model.tie_embeddings": ("transformers' tied Qwen3", "hf_dense"),
    "model.init_std": ("the documented std, measured", "tests/model/test_transformer.py::test_init_std_as_documented"),
    "model.head_dim": ("transformers' Qwen3-MoE (head_dim != dim / heads)", "hf"),
    "model.rope_style": ("transformers' rotate-half; DeepSeek-V3's interleave", "tests/interop/test_families.py::test_deepseek_rope_interleave_false"),
    "model.partial_rotary_factor": ("transformers' GLM-4.5 and MiniMax-M2 modeling code (rotary on part of each head)", "hf"),
    "model.mtp_depth": ("a position-by-position hand computation of the DeepSeek-V3 report's MTP equations (loss and every gradient)", "tests/model/test_mtp.py::test_mtp_loss_and_gradient_equal_the_reports_equations"),
    "model.mtp_loss_weight": ("the same hand computation: the weighted mean of the MTP losses added to the LM loss", "tests/model/test_mtp.py::test_mtp_loss_and_gradient_equal_the_reports_equations"),
    "model.rope_scaling": ("transformers' YaRN (DeepSeek-V3) and llama3 (Llama); linear by hand", "hf"),
    "model.rope_scaling_factor": ("transformers' YaRN and llama3; linear: positions / factor", "closed"),
    "model.rope_original_max_seq_len": ("transformers' YaRN and llama3 tables", "hf"),
    "model.rope_yarn_beta_fast": ("transformers' YaRN (DeepSeek-V3)", "hf"),
    "model.rope_yarn_beta_slow": ("transformers' YaRN (DeepSeek-V3)", "hf"),
    "model.rope_yarn_mscale": ("transformers' YaRN attention factor (DeepSeek-V3)", "hf"),
    "model.rope_yarn_mscale_all_dim": ("transformers' MLA softmax scale (DeepSeek-V3)", "hf"),
    "model.rope_yarn_truncate": ("transformers' YaRN with truncate false (gpt-oss); without it the logits leave transformers'", "hf_gpt_oss"),
    "model.rope_llama3_low_freq_factor": ("transformers' llama3 RoPE (Llama)", "hf_dense"),
    "model.rope_llama3_high_freq_factor": ("transformers' llama3 RoPE (Llama)", "hf_dense"),
    "model.qk_norm": ("transformers' Qwen3-MoE (per head) and OLMoE (whole projection)", "hf"),
    "model.qkv_bias": ("transformers' Qwen2-MoE", "hf"),
    "model.out_bias": ("closed form: the output bias adds to the attention output", "closed"),
    "model.clip_qkv": ("transformers' OLMoE", "hf"),
    "model.attention_sinks": ("a per-query softmax with the head's sink logit by hand, and its gradient; transformers' gpt-oss eager attention (tests/interop)", "tests/model/test_masks.py::test_attend_is_a_softmax_over_the_allowed_keys"),
    "model.attention": ("transformers' DeepSeek-V3 MLA", "hf"),
    "model.q_lora_rank": ("transformers' DeepSeek-V3 MLA", "hf"),
    "model.kv_lora_rank": ("transformers' DeepSeek-V3 MLA", "hf"),
    "model.qk_nope_head_dim": ("transformers' DeepSeek-V3 MLA", "hf"),
    "model.qk_rope_head_dim": ("transformers' DeepSeek-V3 MLA", "hf"),
    "model.v_head_dim": ("transformers' DeepSeek-V3 MLA", "hf"),
    "model.document_mask": ("the block-causal mask built by hand; a per-query softmax", "tests/model/test_masks.py::test_dense_mask_is_the_hand_built_one"),
    "model.document_positions": ("positions restarting at each document, by hand", "tests/model/test_masks.py::test_document_indices_positions_and_lengths_by_hand"),
    "model.sliding_window": ("the windowed mask by hand; each layer's receptive field", "tests/model/test_masks.py::test_a_sliding_window_limits_what_each_layer_sees"),
    "model.sliding_window_layers": ("each layer's receptive field, by hand", "tests/model/test_masks.py::test_a_sliding_window_limits_what_each_layer_sees"),
    "model.attention_backend": ("the sdpa backend's numbers (FlexAttention, -m slow)", "tests/model/test_masks.py::test_flex_backend_gives_the_sdpa_numbers"),
    "model.init_from": ("transformers' own first loss on the same tokens", "tests/interop/test_init_from.py::test_init_from_trains_from_transformers_loss"),
    "model.upcycle_from": ("upcycled at step 0 equals the dense transformers model", "upcycle"),
    "model.upcycle_granularity": ("the dense FFN split in parts sums back to it", "upcycle_parts"),
    "model.upcycle_router_std": ("the router's std, measured", "upcycle_parts"),
    "model.upcycle_noise": ("the experts' noise, measured against the dense weights", "upcycle_parts"),
    # MoE layers and routing
    "moe.num_experts": ("a float64 per-token loop; transformers", "loop"),
    "moe.top_k": ("a float64 per-token loop; one expert top-1 equals the dense MLP", "loop"),
    "moe.every_n_layers": ("which layers are MoE, by hand", "placement"),
    "moe.expert_ffn_dim": ("a float64 per-token loop; transformers", "loop"),
    "moe.num_shared_experts": ("a float64 per-token loop; transformers' Qwen2-MoE, DeepSeek-V3", "loop"),
    "moe.shared_expert_ffn_dim": ("transformers' Qwen2-MoE", "hf"),
    "moe.score_func": ("a float64 per-token loop; transformers (softmax; DeepSeek sigmoid)", "loop"),
    "moe.renormalize": ("hand values; transformers' OLMoE (off) and Qwen3-MoE (on)", "router"),
    "moe.jitter_eps": ("the drawn factors within [1 - eps, 1 + eps], in training only", "jitter"),
    "moe.capacity_factor": ("the capacity table by hand; dropless equals no-drop capacity", "plan"),
    "moe.drop_policy": ("the kept assignments by hand", "policy"),
    "moe.pad_to_capacity": ("the padded rows by hand", "pad"),
    "moe.token_group_seqs": ("capacity per token group by hand", "groups"),
    "moe.aux_loss_coef": ("the switch loss by hand; its injected gradient by autograd", "inject"),
    "moe.seq_aux_loss_coef": ("the sequence loss by hand, per sequence", "records"),
    "moe.global_aux_loss_coef": ("the definition on the whole global batch", "global"),
    "moe.z_loss_coef": ("logsumexp^2 by hand; its injected gradient by autograd", "inject"),
    "moe.expert_bias_rate": ("the sign update by hand", "bias"),
    "moe.quantile_balancing": ("the required biases, histogram and quantile of 4 tokens by hand; the estimate against torch.quantile of the exact required biases", "tests/model/test_quantile_balance.py::test_hand_computation"),
    "moe.quantile_balancing_ema": ("the layer's update by hand at ema 0 and 0.5", "tests/model/test_quantile_balance.py::test_the_layer_counts_its_forwards_and_updates_its_bias"),
    "moe.quantile_balancing_bins": ("the histogram of 4 bins by hand; 1000 bins within two bin widths of torch.quantile", "tests/model/test_quantile_balance.py::test_the_estimate_is_the_exact_quantile_to_within_a_bin"),
    "moe.kernels": ("kernels/*/reference.py (each op's oracle); the torch path's forward, gradients and losses", "tests/train/test_triton_path.py::test_training_losses_match_torch_path"),
    "moe.dense_layers": ("transformers' DeepSeek-V3 and Qwen3-MoE dense layers", "hf"),
    "moe.shared_expert_gate": ("transformers' Qwen2-MoE", "hf"),
    "moe.route_with_bias": ("transformers' DeepSeek-V3 score correction (and without it, not)", "hf_options"),
    "moe.n_groups": ("transformers' DeepSeek-V3 group-limited routing", "hf_options"),
    "moe.group_score": ("the per-token routing loop of kernels/router/reference.py (top-2 sum vs best expert per group); transformers' DeepSeek-V2 group_limited_greedy", "tests/kernels/test_kernels_router.py::test_group_limited_routing_matches_reference"),
    "moe.topk_groups": ("transformers' DeepSeek-V3 group-limited routing", "hf_options"),
    "moe.routed_scaling_factor": ("transformers' DeepSeek-V3", "hf_options"),
    "moe.router_bias": ("transformers' gpt-oss router (softmax over the biased top-k logits)", "hf_gpt_oss"),
    "moe.expert_ffn_bias": ("transformers' gpt-oss experts (gate_up_proj_bias, down_proj_bias)", "hf_gpt_oss"),
    "moe.expert_activation": ("transformers' gpt-oss experts (the clamped SwiGLU, clamps reached)", "hf_gpt_oss"),
    "moe.swiglu_alpha": ("transformers' gpt-oss experts with swiglu_alpha 1.5", "hf_gpt_oss"),
    "moe.swiglu_limit": ("transformers' gpt-oss experts with swiglu_limit 0.4 (reached by the tiny model)", "hf_gpt_oss"),
    "moe.force_load_balancing": ("each token's experts (t K + j) mod E and its output, by hand in float64; every expert exactly its share", "tests/model/test_balanced_routing.py::test_every_expert_gets_exactly_its_share"),
    # data
    "data.dataset": ("the documents of the file, decoded back", "tests/data/test_loading.py::test_packed_local_text_decodes_to_the_documents"),
    "data.dataset_config": ("datasets.load_dataset's own configuration name, handed to it", "tests/data/test_loading.py::test_a_hub_dataset_config_is_handed_to_load_dataset"),
    "data.format": ("text, json and parquet give the same documents", "formats"),
    "data.literal_special_tokens": ("decoding: text spelling <|endoftext|> decodes back to itself and holds no end-of-text id unless 'special' is asked", "tests/data/test_document_boundaries.py::test_literal_special_tokens_are_text_unless_asked"),
    "data.split": ("the files of the split, by hand", "folders"),
    "data.eval_split": ("the held-out files, by hand", "folders"),
    "data.eval_fraction": ("held out per domain, counted", "heldout"),
    "data.text_column": ("the same documents from every format", "formats"),
    "data.domain_column": ("the eval tokens' domains counted independently", "tests/train/test_specialization.py::test_specialization_tables_match_an_independent_count"),
    "data.streaming": ("the same tokens as the map-style dataset", "tests/data/test_loading.py::test_streaming_and_map_style_read_the_same_tokens"),
    "data.tokenizer": ("a tokenizer.json round trip; transformers' declared eos", "tests/data/test_tokenizer.py::test_tokenizer_json_file"),
    "data.seq_len": ("shifted packed windows of the token stream, by hand", "packing"),
    "data.seed": ("same seed same batches, another seed other ones", "tests/data/test_batches.py::test_same_seed_same_batches_other_seed_other_batches"),
    "data.mix": ("each sequence from one dataset with its weight, counted", "tests/data/test_mix.py::test_mixture_draws_each_sequence_from_one_dataset_with_its_weight"),
    # optimizer
    "optim.lr": ("the warmup-cosine values by hand", "schedule"),
    "optim.min_lr_ratio": ("the warmup-cosine values by hand", "schedule"),
    "optim.warmup_steps": ("the warmup-cosine values by hand", "schedule"),
    "optim.schedule": ("the constant schedule by hand", "tests/train/test_optim.py::test_constant_and_no_warmup"),
    "optim.weight_decay": ("decay on matrices only, by hand", "tests/train/test_optim.py::test_weight_decay_only_hits_matrices"),
    "optim.beta1": ("torch.optim.AdamW (the values reach its groups)", "adamw"),
    "optim.beta2": ("torch.optim.AdamW (the values reach its groups)", "adamw"),
    "optim.eps": ("torch.optim.AdamW (the values reach its groups)", "adamw"),
    "optim.grad_clip": ("torch.nn.utils.clip_grad_norm_", "tests/train/test_optim.py::test_clip_grad_norm"),
    "optim.qk_clip": ("each head's largest logit written out by hand from the q and k the attention is handed; after the rescale a clipped head's largest logit is tau and every other head's bit for bit the same, for GQA, MHA with biases and MLA", "tests/model/test_qk_clip.py::test_rescale_leaves_clipped_heads_at_tau_and_the_rest_bit_for_bit"),
    "optim.moments_dtype": ("torch.optim.AdamW with its moments rounded to bf16 after every step", "tests/train/test_optim.py::test_bf16_moments_are_torch_adamw_rounded_each_step"),
    "optim.name": ("torch.optim.Muon (adjust_lr_fn match_rms_adamw) on 2-D parameters, bit for bit, and on each expert's slice of a 3-D tensor; torch.optim.AdamW on the rest", "muon"),
    "optim.muon_momentum": ("torch.optim.Muon with the same momentum", "muon"),
    "optim.muon_ns_steps": ("the quintic Newton-Schulz iteration written out in float64 per matrix", "tests/train/test_muon.py::test_fp32_newton_schulz_is_the_iteration_and_orthogonalizes"),
    "optim.muon_ns_dtype": ("bf16: torch.optim.Muon (which runs it in bf16); fp32: the iteration written out in float64", "tests/train/test_muon.py::test_fp32_newton_schulz_is_the_iteration_and_orthogonalizes"),
    "optim.muon_distributed": ("the whole matrix orthogonalized where it is whole (every holder gathering it, as one process holds it), bit for bit, on every kind of split: FSDP2 rows, TP blocks, ZeRO-3 over TP, replicas, empty slices, kept experts", "tests/train/test_muon_owners.py::test_owners_give_every_holder_the_bits_of_the_gathered_iteration"),
    "optim.muon_update_rms": ("torch.optim.Muon's match_rms_adamw scaling (0.2); the update's RMS measured against the key", "tests/train/test_muon.py::test_update_rms_is_about_the_key"),
    "optim.muon_embedding": ("the parameters each choice moves to Muon, by name", "muon_params"),
    "optim.muon_output": ("the parameters each choice moves to Muon, by name", "muon_params"),
    "optim.muon_router": ("the parameters each choice moves to Muon, by name", "muon_params"),
    # training
    "train.steps": ("the schedule's length by hand; golden curves", "schedule"),
    "train.global_batch_size": ("the global batch whatever the layout", "tests/data/test_batches.py::test_global_batch_does_not_depend_on_the_layout"),
    "train.micro_batch_size": ("accumulated micro-batches equal the whole batch's definition", "global"),
    "train.seed": ("the same init for a seed, another for another", "tests/model/test_transformer.py::test_init_is_deterministic_in_seed"),
    "train.device": ("the triton-vs-torch training check (GPU suite); torch path on CPU", "tests/train/test_triton_path.py::test_layer_forward_and_gradients_match_torch_path"),
    "train.dtype": ("fp32 training of the same model over 20 steps", "tests/train/test_bf16.py::test_bf16_loss_tracks_fp32_over_20_steps"),
    "train.eval_batches": ("the same eval sequences every time", "tests/data/test_batches.py::test_eval_batches_are_identical_every_time_and_independent_of_the_seed"),
    "train.resume": ("the uninterrupted run", "resume"),
    "train.checkpoint_async": ("the synchronous save's checkpoints, tensor for tensor, and the uninterrupted run after a kill during the save", "tests/train/test_async_checkpoint.py::test_the_trainers_asynchronous_checkpoints_are_the_synchronous_ones"),
    "train.nonfinite_policy": ("the parameters before the skipped step", "nonfinite"),
    "train.max_nonfinite_skips": ("the count of skipped steps", "nonfinite"),
    "train.routing_replay": ("the run's own routing replayed reproduces it exactly", "replay"),
    "train.record_routing": ("the recorded ids are the router's", "replay"),
    "train.benchmark": ("a permission: moe.force_load_balancing is refused without it, accepted with it", "tests/model/test_balanced_routing.py::test_training_refuses_it_unless_the_run_is_a_benchmark"),
    "train.fp8": ("the recipe written by hand: e4m3 / e5m2 grids built from their definitions, round-to-nearest-even by search, per-token, per-tensor and per-row scales, power-of-two scales by frexp; the GEMMs and gradients composed from that quantizer", "tests/kernels/test_kernels_fp8.py::test_emulated_linear_is_the_recipe_by_hand"),
    "train.fp8_experts": ("each expert's rows of the grouped GEMM equal the hand recipe's linear with that expert's weight, gradients included", "tests/kernels/test_kernels_fp8.py::test_emulated_grouped_mm_is_the_recipe_by_hand_per_expert"),
    "train.fp8_backend": ("torch._scaled_mm (torch's CPU kernel; CUDA _scaled_mm and _scaled_grouped_mm in the gpu tests) on the same FP8 values against the emulated path", "tests/kernels/test_kernels_fp8.py::test_scaled_mm_backend_matches_emulated"),
}
# fmt: on

GAPS: dict[str, str] = {
    "train.compile": "compiled blocks run beside eager ones only in tools/bench_e2e.py on a GPU, "
    "which times them; on two shared CPU cores inductor did not finish a two-step comparison "
    "within 15 minutes",
}
"""Options whose independent check is missing from the suite, with why: listed on the page as
such, never silently. A new option gets a row, not an entry here."""

NO_NUMBERS: dict[str, str] = {
    "data.trust_remote_code": "a permission handed to datasets.load_dataset",
    "data.cache_dir": "where tokenized data and the default tokenizer are cached",
    "train.output_dir": "where the run writes",
    "train.eval_every": "when evaluation runs (no state of training changes)",
    "train.checkpoint_every": "when checkpoints are written (resume: train.resume)",
    "train.keep_last": "how many checkpoints are kept",
    "train.collective_timeout_s": "how long a collective waits before failing",
    "train.memory_check": "whether a start that cannot fit is refused before it allocates",
    "train.memory_per_rank_gb": "the memory figure that check compares the plan with",
    "train.resume_allow_changes": "which config changes a resume accepts "
    "(tests/train/test_resume_honesty.py)",
    "model.allow_unused_tensors": "whether a start from a checkpoint may leave some of its tensors "
    "unused (tests/interop/test_tensor_accounting.py)",
}
"""Keys of ``SECTIONS`` that change no trained number, with why."""
