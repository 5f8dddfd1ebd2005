"""Tool calling: `tools` / `tool_choice` validation, the grammar that forces a call, and the parser that
reads calls out of the model's text as it streams. API process; imports only server/ siblings, structured
output params and the top-level leaves."""
