"""What a chat request becomes before it reaches the engine: its checks (the template is the
server's, the sizes engine/limits.py allows), its tools and structured output (one grammar at
most), the chat template rendered and tokenized (off the loop: server/prompts.py), OpenAI's
max_tokens default, and the grammar held until a reasoning model's thinking ends. The chat
route (server/routes_openai.py) submits what this returns and renders the output; nothing
here knows about HTTP beyond ApiError.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tritonserve.engine import SamplingParams

from . import harmony
from .chat_template import ChatTemplate
from .common import ApiError, check_chat_size, sampling_params
from tritonserve.engine.reasoning_end import END as REASONING_END
from .reasoning import ReasoningSplitter
from .schema import ChatCompletionRequest
from .structured import structured_output
from .tools import ToolPlan, tool_plan


@dataclass(frozen=True)
class PreparedChat:
    prompt_ids: list[int]
    prompt_text: str  # the rendered template (the reasoning parser reads its end)
    params: SamplingParams
    plan: ToolPlan | None  # the request's tools, None without any
    template: ChatTemplate


async def prepare_chat(state, body: ChatCompletionRequest) -> PreparedChat:
    """Raises ApiError / InvalidRequestError (400 naming the field) having queued nothing."""
    template = state.template
    if body.chat_template is not None:
        raise ApiError(400, "invalid_request", "a chat template is server configuration "
                       "(--chat-template), never request data", "chat_template")
    engine = state.engine
    check_chat_size(body.messages, body.tools, engine.limits)
    kwargs = template.kwargs_for(body.chat_template_kwargs, body.reasoning_effort)
    plan = tool_plan(body.tools, body.tool_choice, template.tool_parser,
                     body.parallel_tool_calls)
    structured = structured_output(body)
    forced = plan.structured() if plan is not None else None
    if forced is not None and template.harmony:
        raise ApiError(400, "invalid_request", "a required or named tool_choice is not "
                       "supported for harmony-format (gpt-oss) models: the call is written in "
                       "the model's own channel; use tool_choice auto", "tool_choice")
    if forced is not None and structured is not None:
        raise ApiError(400, "invalid_request", "a required or named tool_choice cannot be "
                       "combined with response_format", "tool_choice")
    messages = [m.for_template() for m in body.messages]
    prompt_ids, prompt_text = await engine.prompts.encode_chat(
        messages, plan.tools if plan else None, template, kwargs)
    max_tokens = body.max_completion_tokens
    if max_tokens is None:  # OpenAI's default: whatever the context leaves
        max_tokens = body.max_tokens or max(1, engine.card.max_model_len - len(prompt_ids))
    top = body.top_logprobs if body.logprobs else None
    params = sampling_params(body, (top or 0) if body.logprobs else None, max_tokens,
                             forced or structured)
    if template.harmony:
        # the channel markers are special tokens: the parser reads them in the text
        # (server/harmony.py); a grammar applies to the final channel's body
        params = dataclasses.replace(params, skip_special_tokens=False, structured_after=(
            harmony.FINAL_OPENS if params.structured is not None else ""))
    elif params.structured is not None and template.reasoning_parser is not None \
            and ReasoningSplitter(template.reasoning_parser, prompt_text).may_reason:
        # the grammar applies to the answer, after the reasoning (as vLLM does)
        params = dataclasses.replace(params, structured_after=REASONING_END)
    return PreparedChat(prompt_ids, prompt_text, params, plan, template)
