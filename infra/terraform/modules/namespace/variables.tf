variable "name" {
  description = "Namespace to create (or use, with create_namespace = false)."
  type        = string
}

variable "create_namespace" {
  description = "Create the namespace; false = it exists already."
  type        = bool
  default     = true
}

variable "labels" {
  description = "Extra labels for the namespace and the secret."
  type        = map(string)
  default     = {}
}

variable "secret_name" {
  description = "Name of the credentials secret created in the namespace."
  type        = string
}

variable "secret_data" {
  description = "The secret's variables (name => value), exposed to pods as environment variables."
  type        = map(string)
  sensitive   = true
}
