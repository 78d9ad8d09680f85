package cyclo

// exemptTests were the tests over the bar when it was set; they left the
// list as they were cut into steps, and it is empty now: a test
// over the bar fails like any other function.
var exemptTests = map[string]string{}
