"""OpenAI's Responses API (``/v1/responses``) on top of the engines' chat completions.

The pure parts, used by the router and the background executor alike:

- :mod:`router.responses.ids`: the ids OpenAI's shapes carry (``resp_``, ``msg_``...);
- :mod:`router.responses.request`: the create body llmgw accepts, validated;
- :mod:`router.responses.translate`: a request (and the conversation before it)
  as the chat-completions body an engine serves, and the continuation of a
  partial answer;
- :mod:`router.responses.events`: the engine's chat chunks as Responses stream
  events and the final Response object, resumable from the events stored.
"""

LAYER = "gateway"  # this package's layer in the dependency rule: tests/test_layers.py
