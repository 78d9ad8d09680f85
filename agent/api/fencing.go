package api

import "github.com/whitesky-cloud/vco-storage/fence"

// FencingOf is the API's name of a fencing method (package fence names
// each method once; this is the one conversion at the API's edge).
func FencingOf(m fence.Method) FencingMethod {
	switch m {
	case fence.MethodPR:
		return FencingMethod_FENCING_METHOD_SCSI3_PR
	case fence.MethodLease:
		return FencingMethod_FENCING_METHOD_DISK_LEASE
	case fence.MethodNone:
		return FencingMethod_FENCING_METHOD_NONE
	}
	return FencingMethod_FENCING_METHOD_UNSPECIFIED
}

// Method is the fencing method x names, "" for none given.
func (x FencingMethod) Method() fence.Method {
	switch x {
	case FencingMethod_FENCING_METHOD_SCSI3_PR:
		return fence.MethodPR
	case FencingMethod_FENCING_METHOD_DISK_LEASE:
		return fence.MethodLease
	case FencingMethod_FENCING_METHOD_NONE:
		return fence.MethodNone
	}
	return ""
}
