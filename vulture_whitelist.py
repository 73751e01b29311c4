"""Names vulture cannot see used: each is called or read by Python, a library or a framework, by name.

``make lint`` runs ``vulture`` with ``[tool.vulture]`` in ``pyproject.toml`` (mpdoctor, tests, bench and this
file, at 60% confidence; functions under ``@check`` and ``@pytest.fixture`` are registered by their decorator).
Only a name used dynamically belongs here, with its reason on its line; dead code is deleted instead.
This file is read by vulture, never imported.
"""

# ruff: noqa
_ = object()

# -- Python's protocols ---------------------------------------------------------------------------------------
_.__getattr__  # PEP 562: the packages' lazy names (mpdoctor, crash, emulation, numerics)
_.__dir__  # PEP 562: dir(mpdoctor) lists the lazy names

# -- IPython ----------------------------------------------------------------------------------------------------
_._repr_pretty_  # IPython's pretty printer (Report, EnvReport)
_._repr_html_  # IPython's rich display (Comparison)
_._ipython_no_var_expand  # IPython's magic decorator flag: the line is not expanded

# -- the runtime observers' hooks, dispatched by name (runtime/dispatch.py: getattr(observer, method)) ---------
_.on_scale
_.on_unscale
_.on_clip
_.on_step
_.after_step
_.on_optimizer_step
_.on_update
_.after_update
_.on_scheduler_step

# -- Lightning calls its callbacks' and modules' hooks by name -----------------------------------------------------
_.on_fit_start
_.on_train_start
_.on_before_backward
_.on_before_optimizer_step
_.on_fit_end
_.on_exception
_.configure_optimizers
_.automatic_optimization  # read by Lightning's loop: manual optimization
_.batch_idx  # training_step's signature is Lightning's

# -- pytest reads these by name ----------------------------------------------------------------------------------
_.pytestmark  # a module's marks
_.pytest_runtest_makereport  # conftest hooks
_.pytest_make_collect_report
_.pytest_ignore_collect
_.pytest_collection_modifyitems
_.pytest_configure
_.pytest_terminal_summary

# -- attributes a library reads after a test or benchmark sets them --------------------------------------------------
_.router  # nn.Module.__setattr__ registers the submodule (bench/bench_diagnose.py)
_.fp8_weight  # nn.Module.__setattr__ registers the parameters (tests/scenarios.py)
_.int_weight
_.c_weight
_.ghost
_.attention_dropout  # read by transformers' attention in the forward (tests/test_compare*.py)
_.pre_tokenizer  # read by tokenizers' Tokenizer.train_from_iterator (tests/stack/test_trl.py)
_.cdb  # DeepSpeed's "communication initialised" global (tests/stack/test_deepspeed_configs.py)
_.min_new_tokens  # generation-config fields generate() reads (bench/bench_probe_generate.py, tests/test_probe_generate.py)
_.suppress_tokens
_.do_sample
_.pad_token_id

_.custom_attribute  # config attributes mpdoctor reads through the config's __dict__ (tests/test_security.py)
_._attn_implementation_internal
_.hub_token
_._name_or_path

# -- called by the standard library or a test harness by name ------------------------------------------------------------
_.__eq__  # a metaclass's == protocol, which a hostile namespace turns against the caller (tests/scenarios.py)
_.handle_starttag  # html.parser.HTMLParser's callback (tests/test_security.py)
_.LazyModuleLoaded  # raised by the lazy module's source text, written by tests/scenarios.py
_.ddp_fp32_vs_bf16  # a distributed worker, started by name (tests/distributed/dist_harness.run_processes)

# -- fixtures requested for their effect only: the test names them and never reads the value ------------------------------
_.te_distribution
_.tf32_state
_.one_rank_group  # imported into tests/stack/test_cures_deepspeed.py so pytest runs it there (autouse)
_._no_deepspeed_env_leaks_between_tests  # the same

# -- fields filled and read by name ---------------------------------------------------------------------------------------
_.bf16_overflow  # the scan's per-tensor counts: filled by cnt.add("bf16_overflow", ...), read as row keys (diagnosis/scan_rows.py)
_.bf16_underflow
_.starts  # _Round.starts: called by the marks replay.py places in the cell it replays
