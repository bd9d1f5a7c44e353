"""``LLM.get_metrics``' dictionary, assembled from the engine, the weight updater and the memory
manager (``llm_metrics``)."""

from __future__ import annotations

from specengine.ops.extension import ext


def llm_metrics(engine, weights, memory, generate_time: float) -> dict:
    """Engine counters since start: requests, prompt/generated tokens, steps, prefill and
    decode time (seconds), preemptions, KV blocks (total and free), wall time in
    ``generate`` (seconds); with speculation, the policy's ``stats()`` (strategies run,
    steps, predicted and observed tokens/s, decision time; with ``auto`` also
    ``policy_budget``, how draft nodes were spread over sequences,
    ``policy_remaining``, the remembered output lengths, and ``policy_guard``, the loss
    guard's account per batch bucket and the speculative steps it refused) and
    ``tau_per_weight_version`` (target weight version -> tokens committed per verify step
    while it served: drift after a weight update shows here); with an EAGLE drafter (also
    inside a ``Harvester`` or merged with others), ``drafter_version`` and ``tau_per_version``
    (drafter version -> tokens committed per verify step, see ``EagleDrafter.stats``); with
    several drafters merged, ``merged_nodes_proposed`` / ``merged_nodes_kept`` per source,
    ``merged_base`` (merges each source was the base of) and ``merged_matched_per_draft``
    (tokens each source's own tree would have had accepted, per draft;
    ``MergedDrafter.stats``); with speculation, ``source_stats``: per draft source, nodes
    verified and accepted, overall and per depth (``sources.SourceStats``), and where the
    policy calibrates per source (``auto``, or any policy with a merged drafter) its
    ``calibration`` map (acceptance probability per confidence bin, also in
    ``policy_calibration_per_source``); with the suffix drafter, ``rollout_memory_bytes`` /
    ``_groups`` / ``_tokens`` / ... and the index update and lookup seconds
    (``suffix_update_seconds``, ``suffix_lookup_seconds``, totals and per step; see
    ``SuffixDrafter.stats``). Always: ``weight_version``,
    ``weight_updates``, ``weight_update_time`` / ``last_weight_update_time`` (seconds
    applying updates) and ``sleep_level`` (0 awake, else the deepest level slept); prefix
    caching: ``prefix_cache_hit_rate`` (hit / queried prompt tokens),
    ``prefix_cache_hit_tokens``, ``prefix_cache_queried_tokens``,
    ``prefix_cache_rerun_tokens`` (hit tokens run again for their logits),
    ``prefix_cache_blocks`` (cached now; those nobody uses count in ``kv_blocks_free``,
    evicted on demand); migration (``specengine.lifecycle.migration.Migrator``):
    ``migration_stage1_seconds`` / ``_bytes``, ``migration_stage2_seconds`` / ``_bytes``,
    ``migration_import_seconds`` / ``_bytes``, ``migrated_out`` / ``migrated_in`` (with
    K/V), ``reprefilled_out`` / ``reprefilled_in`` (as tokens); threads
    (``specengine.ops.threads.ThreadTuner.stats``): ``kernel_threads`` (forward-size bucket ->
    the kernels' thread count chosen), ``kernel_threads_max``, ``thread_probes``,
    ``thread_switches``, ``adaptive_threads``, and ``kernel_pool``, the process's kernel
    pool counters (jobs, helper_chunks, waits and sleeps of the caller for a helper's
    chunk, wait_ns, late_helpers; see ``csrc/pool.h``).

    Args:
        engine: the ``Engine``. weights: its ``WeightUpdater``. memory: its
            ``MemoryManager``. generate_time: seconds spent in ``generate`` / ``step``.
    """
    d = engine.metrics.as_dict()
    d.update(kv_blocks_total=engine.config.num_kv_blocks,
             kv_blocks_free=engine.num_free_kv_blocks(), generate_time=generate_time,
             sleep_level=memory.level, **weights.stats())
    d.update(engine.threads.stats())
    if hasattr(ext(), "pool_stats"):  # (an extension built before it has none)
        d["kernel_pool"] = ext().pool_stats()
    d.update(engine.prefix_cache_stats())
    drafter = engine.drafter
    if drafter is not None:
        d.update(engine.policy.stats())
        d["tau_per_weight_version"] = weights.tau_per_weight_version()
        d.update(drafter.stats())  # EAGLE: versions; suffix: rollout memory and its costs
    for src, cal in d.get("policy_calibration_per_source", {}).items():
        if src in d.get("source_stats", {}):
            d["source_stats"][src]["calibration"] = cal
    return d
