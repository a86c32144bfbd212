"""Declarative policies: the language (``schema``), their evaluation (``engine``) and tests
(``testrun``). Pure: data and a time value in, decisions out; nothing here sends or restarts."""
