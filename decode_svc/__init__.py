"""decode_svc"""
