"""gateway"""
