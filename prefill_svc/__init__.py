"""prefill_svc"""
