"""Prefect tasks and the plain functions behind them: one package per stage (datasets, generate, records, capture,
train, eval, doctor), the serving engines' client side (serving/, the counterpart of emulators/), the responses
store every stage after generate reads (responses/), and the runtime every command shares (runtime/)."""
