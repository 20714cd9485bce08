"""The admin quota APIs (Describe/AlterClientQuotas) answered by the proxy itself."""
