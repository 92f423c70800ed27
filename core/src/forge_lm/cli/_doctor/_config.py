"""Checks of the run config (file and overrides, with the plugins' components) and of what it
asks of this machine: the device, the precision on it, the peak FLOP/s that MFU divides by, and
the kernel its fp32 CPU linear products take. The config check hands the valid config to the
checks after it through the context."""

from __future__ import annotations

from forge_lm.cli._doctor._check import FAIL, OK, WARNING, Check, Context


def config(context: Context) -> list[Check]:
    from forge_lm.config import load_config
    from forge_lm.errors import ForgeError

    what = context.config_path or "the default config"
    if context.overrides:
        what += f" with {len(context.overrides)} override(s)"
    try:
        loaded = load_config(context.config_path, context.overrides, context.manager.registry)
        context.manager.configure(loaded)
    except ForgeError as exc:
        return [Check("config", FAIL, f"{what}: {exc}")]
    context.config = loaded
    return [Check("config", OK, f"{what} is valid")]


def device(context: Context) -> list[Check]:
    """Nothing without a valid config (the config row says why) or without torch."""
    if context.config is None or context.torch is None:
        return []
    from forge_lm.errors import ForgeError
    from forge_lm.train.device import resolve_device

    setting = context.config.train.device
    try:
        resolved = resolve_device(setting)
    except ForgeError as exc:
        return [Check("device", FAIL, str(exc))]
    return [Check("device", OK, f"train.device '{setting}': the run computes on {resolved}")]


def precision(context: Context) -> list[Check]:
    """What ``[train] precision`` means on the run's device and, on a CPU, whether bf16 would be
    faster there or slower: it has bf16 matrix instructions or torch emulates them. ``"auto"``
    stays fp32 on every CPU (a run's numbers should not depend on the CPU it lands on), so the
    faster choice is pointed out rather than taken. ``"fp16"``: whether float16 autocast runs on
    the device (every CUDA GPU has fp16; on a CPU a tiny autocast product is run to see) and, on
    a CPU, whether it has fp16 matrix instructions. Nothing when the device does not resolve."""
    resolved = _run_device(context)
    if resolved is None:
        return []
    from forge_lm.hardware import cpu_multiplies_bf16
    from forge_lm.train.device import autocast_dtype

    setting = context.config.train.precision
    dtype = autocast_dtype(setting, resolved)
    if dtype == context.torch.float16:
        return _fp16_precision(context, resolved)
    bf16 = dtype is not None
    what = f"train.precision '{setting}': {'bf16 autocast' if bf16 else 'fp32'} on {resolved.type}"
    if resolved.type != "cpu":
        return [Check("precision", OK, what)]
    if not cpu_multiplies_bf16():
        if bf16:
            return [
                Check(
                    "precision",
                    WARNING,
                    f"{what}, but this CPU has no bf16 matrix instructions (AVX-512 BF16, AMX): torch emulates "
                    "bf16 products, several times slower than fp32. Use --train.precision=fp32 (or 'auto').",
                )
            ]
        return [Check("precision", OK, f"{what}; this CPU has no bf16 matrix instructions, so fp32 is its fastest")]
    if bf16:
        return [Check("precision", OK, f"{what}; this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX)")]
    return [
        Check(
            "precision",
            OK,
            f"{what}; this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX): --train.precision=bf16 "
            "trains faster (1.5x to 2.0x fp32's tokens/s in Forge's benchmark on such a CPU, 2.1x to 2.4x with "
            "--train.compile=true), with bf16's rounding",
        )
    ]


def _fp16_precision(context: Context, device) -> list[Check]:
    """The precision row of ``precision = "fp16"``: fp16 autocast with a dynamic loss scale."""
    from forge_lm.hardware import cpu_multiplies_fp16

    what = f"train.precision 'fp16': fp16 autocast with a dynamic loss scale on {device.type}"
    if device.type != "cpu":
        return [Check("precision", OK, f"{what}; every CUDA GPU computes in fp16")]
    failure = _fp16_autocast_failure(context.torch)
    if failure is not None:
        return [
            Check(
                "precision",
                FAIL,
                f"{what}, but fp16 autocast does not run on this CPU with torch {context.torch.__version__} "
                f"({failure}). Use --train.precision=fp32",
            )
        ]
    if cpu_multiplies_fp16():
        return [Check("precision", OK, f"{what}; fp16 autocast runs, on this CPU's fp16 matrix instructions")]
    return [
        Check(
            "precision",
            WARNING,
            f"{what}: fp16 autocast runs, but this CPU has no fp16 matrix instructions (AVX512-FP16, AMX-FP16): "
            "torch emulates fp16 products, many times slower than fp32. fp16 is meant for GPUs without bf16 "
            "(V100, T4); use --train.precision=fp32 on this CPU (or 'auto').",
        )
    ]


def _fp16_autocast_failure(torch) -> str | None:
    """Why a float16 autocast product fails on the CPU, or None when it runs and gives float16."""
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            product = torch.nn.functional.linear(torch.ones(2, 8), torch.ones(4, 8))
    except (RuntimeError, TypeError, ValueError) as exc:  # a torch build or CPU without fp16 kernels
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if product.dtype != torch.float16:
        return f"a product under fp16 autocast came out in {product.dtype}"
    return None


def peak_flops(context: Context) -> list[Check]:
    """The peak FLOP/s that MFU divides by, and where it comes from; nothing when the device
    does not resolve (the device row says why). A check stays quick, so a CPU peak that would
    have to be measured is only announced: the first run measures it."""
    resolved = _run_device(context)
    if resolved is None:
        return []
    from forge_lm.errors import ForgeError
    from forge_lm.metrics.cpu_peak import known_cpu_peak
    from forge_lm.metrics.mfu import peak_with_source
    from forge_lm.metrics.peak_dtypes import DTYPE_NAMES
    from forge_lm.train.device import autocast_dtype

    config = context.config
    dtype = autocast_dtype(config.train.precision, resolved)
    what = f"{resolved.type} {DTYPE_NAMES.get(dtype, 'fp32')}"  # autocast_dtype: bf16, fp16 or None (fp32)
    configured = config.metrics.peak_flops
    try:
        if resolved.type == "cpu" and configured is None:
            peak, source = known_cpu_peak(context.torch.float32 if dtype is None else dtype)
        else:
            peak, source = peak_with_source(resolved, dtype, configured)
    except ForgeError as exc:
        found = str(exc).removeprefix("[metrics] peak_flops: ")
        return [Check("peak flops", WARNING, f"{what}: {found} Until then training logs no MFU")]
    if peak is None:
        return [Check("peak flops", OK, f"{what}: {source}")]
    return [Check("peak flops", OK, f"{what}: {peak:.3g} FLOP/s, {source}")]


def linear_kernel(context: Context) -> list[Check]:
    """Which kernel an fp32 CPU run's linear products take (``[train] cpu_linear_kernel``) and why:
    for ``"auto"``, the choice measured on this host for this model's products (cached by the
    first run that measured it), or that the first run will measure it. Measures nothing, so the
    check stays quick; left out where the products are not fp32 on a CPU."""
    resolved = _run_device(context)
    if resolved is None:
        return []
    from forge_lm.errors import ForgeError
    from forge_lm.model.linear import onednn_available
    from forge_lm.train.device import autocast_dtype

    config = context.config
    if resolved.type != "cpu" or autocast_dtype(config.train.precision, resolved) is not None:
        return []
    setting = config.train.cpu_linear_kernel
    if setting == "aten":
        return [Check("linear kernel", OK, "cpu_linear_kernel = 'aten': torch's own kernel (F.linear), as configured")]
    if not onednn_available():
        if setting == "onednn":
            return [
                Check(
                    "linear kernel",
                    FAIL,
                    "cpu_linear_kernel = 'onednn', but this torch build has no oneDNN (mkldnn) linear kernel; "
                    "set it to 'auto' or 'aten'",
                )
            ]
        return [Check("linear kernel", OK, "auto: torch's (aten): this torch build has no oneDNN linear kernel")]
    if setting == "onednn":
        return [Check("linear kernel", OK, "cpu_linear_kernel = 'onednn': oneDNN's fp32 GEMM, as configured")]
    try:
        shapes = _linear_shapes(context)
    except ForgeError as exc:
        return [Check("linear kernel", OK, f"auto: chosen by measurement when the run starts ({exc})")]
    from forge_lm.model.linear_choice import cached

    choice = cached(shapes)
    if choice is None:
        return [
            Check(
                "linear kernel",
                OK,
                f"auto: not measured on this host yet; the first fp32 run times oneDNN against torch's kernel on "
                f"the model's {len(set(shapes))} linear products and caches the faster",
            )
        ]
    return [Check("linear kernel", OK, f"auto: {choice.reason}")]


def _run_device(context: Context):
    """The device the valid config's run computes on; None without a valid config or torch, or
    when the device does not resolve (the config and device rows say why)."""
    if context.config is None or context.torch is None:
        return None
    from forge_lm.errors import ForgeError
    from forge_lm.train.device import resolve_device

    try:
        return resolve_device(context.config.train.device)
    except ForgeError:
        return None


def _linear_shapes(context: Context) -> list[tuple[int, int, int]]:
    """The ``(tokens, in, out)`` of the configured model's fp32 linear layers at the run's tokens
    per micro-batch, from the model built on the meta device (nothing allocated)."""
    import torch

    from forge_lm.model.linear_choice import linear_shapes
    from forge_lm.model.memory import model_vocab_size
    from forge_lm.model.transformer import build_model

    config = context.config
    vocab_size = model_vocab_size(config, config.tokenizer.build())
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(config.model, vocab_size, context.manager.registry)
    return linear_shapes(model, config.train.batch_size * config.train.seq_len)


CHECKS = (config, device, precision, peak_flops, linear_kernel)
