"""A tool run's chat template, set up as TRL 1.16's GRPOTrainer sets it up (its __init__, grpo_trainer.py ~650-780),
with TRL's own helpers (trl.chat_template_utils, imported when a tool run starts: common/trl_import.py):

    spec = tool_template(tokenizer, model, chat_template_kwargs)   # ValueError (one line, naming the model)
    spec.family             # whose response template parses the calls: "qwen3", "gptoss", ... (TRL's names)
    spec.training_template  # TRL's training chat template swapped in ("qwen3_training"), or None: the model's own
    spec.render_kwargs      # what every render of the run passes apply_chat_template (prompts, tool suffixes)

In TRL's order:
1. supports_tool_calling: a template that cannot render user -> assistant with tool_calls -> tool is refused
   (DeepSeek-R1-distill's, Llama 3's basic one).
2. The response template transformers' parse_response reads: the tokenizer's own if it has one, else TRL's
   add_response_schema (the chat template compared exactly with those TRL knows), else -- what TRL does not do --
   the embedded tiny model's template (common/tiny_model.py), which writes Qwen2.5's <tool_call>{json} calls:
   TRL's Qwen3 response template. Anything else is refused: its tool calls would never run.
3. is_chat_template_prefix_preserving, else get_training_chat_template: Qwen3's hybrid-thinking template (it adds
   <think>\\n\\n</think>\\n\\n to the last assistant turn only) and gpt-oss's are swapped for TRL's training
   templates; where TRL has none (Llama 3.1/3.2) the run is refused at start, as TRL refuses it.
The tokenizer's own chat_template is left as it is (a checkpoint saved from it keeps the model's template), as
TRL keeps the swapped one in `self.chat_template` and passes it to every render with chat_template_kwargs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.trl_import import trl_module

OWN = "the tokenizer's own response_template"


@dataclass(frozen=True)
class ToolTemplate:
    family: str
    training_template: str | None = None  # TRL's name for it ("qwen3_training"); None: the model's own template
    chat_template: str | None = None  # its text
    chat_template_kwargs: dict = field(default_factory=dict)

    @property
    def render_kwargs(self) -> dict:
        """apply_chat_template's keyword arguments for every render of the run (TRL: chat_template=self.chat_template,
        **self.chat_template_kwargs)."""
        kw = dict(self.chat_template_kwargs)
        if self.chat_template is not None:
            kw["chat_template"] = self.chat_template
        return kw

    def describe(self) -> str:
        return f"calls parsed as {self.family}; chat template " + (
            f"TRL's {self.training_template} (the model's own does not keep the conversation prefix when a tool "
            f"turn follows)" if self.training_template else "the model's own (it keeps the prefix)")


def _tiny_template() -> str:
    from common.tiny_model import CHAT_TEMPLATE
    return CHAT_TEMPLATE


def _name_in_trl(value, suffix: str, kind: type) -> str | None:
    """The name, less `suffix`, of the trl.chat_template_utils object equal to `value` (None: none is)."""
    for name, obj in vars(trl_module("chat_template_utils")).items():
        if name.endswith(suffix) and isinstance(obj, kind) and obj == value:
            return name[:-len(suffix)]
    return None


def set_response_template(tokenizer, model: str = "the model") -> str:
    """TRL's add_response_schema, unless the tokenizer has a response template (or legacy schema) already; the
    embedded tiny model's template gets Qwen3's. The family's name (TRL's), ValueError in one line when none fits."""
    ctu = trl_module("chat_template_utils")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        if tokenizer.chat_template == _tiny_template():
            tokenizer.response_template = ctu.qwen3_template
        else:
            try:
                ctu.add_response_schema(tokenizer)
            except ValueError:  # "Unrecognized chat template": said with the model's name, in one line
                raise ValueError(f"model {model}: its chat template is none of those whose tool calls TRL 1.16 "
                                 f"parses (add_response_schema) and its tokenizer has no response_template, so its "
                                 f"tool calls would never run: use a model of a family TRL parses, or set "
                                 f"tokenizer.response_template (transformers' response parsing) in the checkpoint"
                                 ) from None
    if getattr(tokenizer, "response_template", None) is None:
        return "the tokenizer's own response_schema"
    return _name_in_trl(tokenizer.response_template, "_template", dict) or OWN


def tool_template(tokenizer, model: str = "the model", chat_template_kwargs: dict | None = None) -> ToolTemplate:
    """The tool run's template set-up (module docstring); ValueError, one line naming the model, where TRL refuses."""
    ctu = trl_module("chat_template_utils")
    if not ctu.supports_tool_calling(tokenizer):
        raise ValueError(f"model {model}: its chat template cannot render a tool-calling conversation (user -> "
                         f"assistant with tool_calls -> tool), so TRL 1.16 refuses tools for it "
                         f"(supports_tool_calling): a run with tools needs a model whose template renders them")
    family = set_response_template(tokenizer, model)
    swapped = None
    if not ctu.is_chat_template_prefix_preserving(tokenizer):
        try:
            swapped = ctu.get_training_chat_template(tokenizer)
        except ValueError:  # TRL raises it in GRPOTrainer.__init__: no patched template for this one
            raise ValueError(f"model {model}: its chat template ({family}) renders an assistant turn differently "
                             f"once a tool turn follows (it does not keep the conversation prefix) and TRL 1.16 has "
                             f"no training chat template for it (get_training_chat_template), so GRPOTrainer "
                             f"refuses tools for it: give the model a prefix-preserving chat template") from None
    name = None if swapped is None else _name_in_trl(swapped, "_chat_template", str)
    spec = ToolTemplate(family, name, swapped, dict(chat_template_kwargs or {}))
    try:  # what the first tool call renders: refused now where it would fail then (TRL fails at that call)
        tool_suffix_ids(tokenizer, [{"role": "tool", "name": "dummy", "content": "dummy"}], spec.render_kwargs)
    except ValueError:
        which = f"TRL's training chat template {name}" if name else f"its chat template ({family})"
        raise ValueError(f"model {model}: {which} does not keep the conversation prefix on this tokenizer's ids "
                         f"once a tool turn follows (its special tokens are not single tokens?), so no tool turn "
                         f"can be appended to the model's tokens: TRL 1.16 fails at the first tool call "
                         f"(_get_tool_suffix_ids); give the tokenizer the template's special tokens") from None
    return spec


def tool_suffix_ids(tokenizer, tool_messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The tokens the chat template puts after an assistant turn that called tools: the tool message(s) and the
    next assistant opener. Rendered after a dummy assistant turn (with the real tool name: some templates derive
    the tool header from it), the prefix cut after its last eos (templates add a newline after a turn's end, which
    the model did not sample: that newline belongs to the suffix). template_kwargs: the run's render arguments
    (ToolBox.template_kwargs: chat_template_kwargs, and the training chat_template where TRL swaps one in)."""
    kw = dict(template_kwargs or {})
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = _ids(tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, **kw))
    full = _ids(tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True, **kw))
    ends = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template renders a tool turn that does not extend the conversation before it "
                         "(its rendering of the assistant turn changes when tool messages follow): cannot append "
                         "tool turns without re-tokenising the model's tokens")
    return full[len(prefix):]


def _ids(out) -> list[int]:
    """apply_chat_template(tokenize=True) gives a list, or (transformers 5) a BatchEncoding."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)
