// Package csi is the root of the vco-csi plugin. Its subpackages hold the
// whitesky.cloud API client (cloud), the API simulator the tests and the lab
// drive that client against (sim), and the CSI services (driver).
package csi
