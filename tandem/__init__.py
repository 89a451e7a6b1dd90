"""tandem"""
